"""Data reflow, the offline side: the router's recorded chunks in, inference logs and training data out.

In: the durable buffer queue the router's recorder (router/reflow/) writes. Out:
one inference log per session (JSONL or Parquet) written by the consumer
process (`segserve reflow consume`), and exports of those logs (`segserve
reflow export`: OpenAI chat JSONL, Parquet; `segserve corpus build
--from-reflow`: drafter corpora). None of this runs in a service's request path;
it reads the queue and the chunk format through router.reflow.queue and
router.reflow.chunks.

Modules, in the order data flows:
- assembly.py: chunks back into request records, deduped.
- consumer.py: claim -> reassemble -> write -> ack (common.redact before the write).
- sink.py: per-session log files, idempotent atomic rewrites.
- export.py: OpenAI fine-tuning chat JSONL and Parquet; the generated texts for drafter corpora.
- config.py: ConsumerConfig.
"""
