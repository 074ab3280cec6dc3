"""Data reflow: every request and response the router serves, recorded durably as training data.

In: the router's request handlers call `Recorder.start_request(...)`, then
`.delta(...)` per streamed delta and `.finish(state, usage=...)` on every exit
path. Out: one inference log per session (JSONL or Parquet) written by the
consumer process, and exports of those logs (OpenAI chat JSONL, Parquet).

Modules, in the order data flows:
- chunks.py: the Chunk, request splitting, session ids.
- recorder.py: the hot path's bounded buffer and the writer thread (spill.py: overflow).
- queue.py: the durable buffer queue, SQLite (embedded default) or Redis Streams.
- assembly.py: chunks back into request records, deduped.
- consumer.py: claim -> reassemble -> write -> ack (redact.py before the write).
- sink.py: per-session log files, idempotent atomic rewrites.
- export.py: OpenAI fine-tuning chat JSONL and Parquet.
- config.py: RecorderConfig and ConsumerConfig.
"""

from router.reflow.chunks import Chunk, Direction, FinishState
from router.reflow.config import ConsumerConfig, RecorderConfig
from router.reflow.queue import ChunkQueue, open_queue
from router.reflow.recorder import Recorder, RequestRecording, open_recorder

__all__ = ["Chunk", "ChunkQueue", "ConsumerConfig", "Direction", "FinishState", "RecorderConfig", "Recorder",
           "RequestRecording", "open_queue", "open_recorder"]
