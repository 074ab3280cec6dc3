"""The HTTP front door: OpenAI-compatible API in, gRPC to the scheduler out.

In: HTTP requests (/v1/completions, /v1/chat/completions, /v1/models, /health,
/v2/models/{model}/generate[_stream]).
Out: one `Scheduler.Generate` call per request, in token ids; its token stream
comes back, is detokenized incrementally and is sent as JSON or SSE.

Modules, from the wire inwards:
- protocol.py: request bodies (pydantic) and their conversion to GenerateParams.
- errors.py: OpenAI-shaped errors; bad input is always a 4xx naming the field.
- prompts.py: prompt / chat template to token ids, and the output budget.
- generation.py: one request's event stream as text deltas (+ keep-alive ticks).
- detokenizer.py: incremental detokenization over a small window.
- responses.py: OpenAI response bodies and the renderers building them.
- v2.py: the MindIE/Triton-style /v2 generate routes, their bodies and renderer.
- scheduler_client.py: the grpc.aio client; the only module that touches protobuf.
- app.py: create_app(); server.py: run() / build_app().
"""
