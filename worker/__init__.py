"""The worker: hosts the target model and runs one batched forward per scheduler step.

In (gRPC `segserve.v1.Worker`, see protos/segserve/v1/worker.proto; the Python types are the
contract modules protos/segserve/v1/step.py, step_result.py and info.py):
  - StepRequest: new sequences (sampling parameters, prompt length), the scheduled work
    (token ids from num_computed_tokens on, block table, sample indices, or a CandidateTree the
    worker verifies after its root), finished sequence ids.
Out:
  - StepResult: per sequence, one sampled token (+ score, optional top log-probabilities) per
    sample index (for a verified tree: the accepted drafts + the target's own token), optional
    prompt log-probabilities, or an `error` when that sequence alone failed; for a structured output
    the scheduler drafts forced spans of, the tokens its grammar forces next; the compute time.
  - WorkerInfo: KV-cache blocks and block size, context limit, vocabulary, EOS ids.
  - Health: ready once a real warm-up forward has run.

Modules:
  config           WorkerConfig, the typed configuration.
  validation       per-sequence checks (a failing sequence gets an error output) and InvalidRequest.
  planning         sequence state; a StepRequest becomes a ForwardPlan of Works.
  work             Work: one sequence's tokens as the forward runs them (trees expanded to nodes).
  kv_cache         PagedKVCache: per-layer [num_blocks, block_size, kv_heads, head_dim] K and V.
  attention        the "segserve_paged" attention function under the stock transformers model.
  packed_linear    CPU linears on weights packed once for oneDNN; q/k/v and gate/up siblings as one.
  loading          the model onto its device (whole, or a rank's shard), its linears prepared, its length.
  model_runner     ModelRunner: the packed forward, then sampling and the outputs.
  latent_attention multi-head latent attention served from its latent (DeepSeek-V3).
  sequence_state   state besides the KV cache carried per sequence (LFM2, Mamba hybrids, Qwen3-Next).
  self_check       the start-up check of the worker's path against transformers' reference forward.
  faults           non-finite logits and sampler failures, isolated to their sequence.
  verify           sampling level by level with the tree acceptance walk; KV compaction moves.
  sampler          batched logits processing (logit bias, penalties) and sampling.
  grammar          structured outputs: xgrammar matchers per sequence, their trees pruned, their forced spans.
  grammar_guidance llguidance's matchers, for the JSON schemas xgrammar would approximate, behind the same calls.
  grammar_masks    the token masks of a step's constrained rows (every node of a tree), in one bitmask.
  warpers          temperature, top_k, top_p, typical_p.
  watermark        green-list watermarking and its detector.
  prompt_logprobs  prompt tokens' log-probabilities under the raw model, across prefill chunks.
  server           the grpc.aio servicer and serve(config).
  tensor_parallel  the model split over N ranks: sharded layers and their collectives (RankGroup).
  sharded_load     one rank's shard of a safetensors checkpoint, read slice by slice.
  ranks            rank 0's side: it starts the other ranks, sends them each step, stops with any of them.
  follower         a follower rank's process (`python -m worker.follower`).
  actor            the worker (and its follower ranks) as Ray actors.

The worker owns KV memory; the scheduler owns its allocation (block tables). Model checkpoints
are resolved by common.checkpoint.
"""
