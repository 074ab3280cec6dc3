"""Data reflow, the router's side: every request and response it serves, recorded durably.

In: the router's request handlers call `Recorder.start_request(...)`, then
`.delta(...)` per streamed delta and `.finish(state, usage=...)` on every exit
path. Out: chunks in the durable buffer queue. Draining that queue into
per-session inference logs and exporting them is offline tooling, not the
request path: it lives in segserve/reflow/ (consumer, assembly, sink, export,
redact; `segserve reflow consume|export`).

Modules, in the order data flows:
- gateway.py: the HTTP middleware and delta wrapper that feed the recorder.
- chunks.py: the Chunk, request splitting, session ids.
- recorder.py: the hot path's bounded buffer and the writer thread (spill.py: overflow).
- queue.py: the durable buffer queue, SQLite (embedded default) or Redis Streams.
- config.py: RecorderConfig.
"""

from router.reflow.chunks import Chunk, Direction, FinishState
from router.reflow.config import RecorderConfig
from router.reflow.queue import ChunkQueue, open_queue
from router.reflow.recorder import Recorder, RequestRecording, open_recorder

__all__ = ["Chunk", "ChunkQueue", "Direction", "FinishState", "RecorderConfig", "Recorder",
           "RequestRecording", "open_queue", "open_recorder"]
