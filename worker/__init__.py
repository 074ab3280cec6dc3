"""The worker: hosts the target model and runs one batched forward per scheduler step.

In (gRPC `segserve.v1.Worker`, see protos/segserve/v1/worker.proto):
  - StepRequest: new sequences (sampling parameters, prompt length), the scheduled work
    (token ids from num_computed_tokens on, block table, optional rotary positions and
    n x n attention mask for candidate trees, sample indices, or draft_parents for a
    speculative tree the worker verifies itself), finished sequence ids.
Out:
  - StepResponse: per sequence, one sampled token (+ score, optional top log-probabilities)
    per sample index (for a verified tree: the accepted drafts + the target's own token),
    and the compute time.
  - WorkerInfo: KV-cache blocks and block size, context limit, vocabulary, EOS ids.
  - Health: ready once a real warm-up forward has run.

Modules:
  config        WorkerConfig, the typed configuration.
  checkpoint    resolve_model(): the served checkpoint directory (default gemma-3-270m).
  messages      dataclasses the runner works on, converted from/to protobuf at the edge.
  validation    InvalidRequest checks run before any state changes.
  kv_cache      PagedKVCache: per-layer [num_blocks, block_size, kv_heads, head_dim] K and V.
  attention     the "segserve_paged" attention function under the stock transformers model.
  model_runner  ModelRunner: sequence state, the packed forward, sampling.
  verify        tree verification: layout from draft_parents, acceptance walk, KV compaction moves.
  sampler       batched logits processing and sampling.
  server        the grpc.aio servicer and serve(config).

The worker owns KV memory; the scheduler owns its allocation (block tables).
"""
