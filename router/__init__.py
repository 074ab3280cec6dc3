"""The HTTP front door: OpenAI-compatible API in, gRPC to the scheduler out.

In: HTTP requests (/v1/completions, /v1/chat/completions, /v1/models, /health,
/v2/models/{model}/generate[_stream]).
Out: one `Scheduler.Generate` call per request, in token ids; its token stream
comes back, is detokenized incrementally and is sent as JSON or SSE.

Modules, from the wire inwards:
- app.py: create_app() assembles the app from the route modules around one RouterState
  (state.py, fetched by a FastAPI dependency); server.py: run() / build_app().
- openai_routes.py, v2.py, ops.py: the /v1, /v2 and /health, /ready, /metrics routes (APIRouters).
- protocol.py: OpenAI request bodies (pydantic, types only) and their mapping onto the
  contract (protos/segserve/v1: SamplingParams, StoppingCriteria, GenerateRequest).
- admission.py: the contract's validate_request on every request, as a 400 naming the field.
- errors.py: OpenAI-shaped errors; bad input is always a 4xx naming the field.
- prompts.py: prompt / chat template to token ids, and the output budget.
- serving.py: running jobs and answering with JSON or SSE (keep-alives, disconnects).
- generation.py: one request's event stream as text deltas (+ keep-alive ticks).
- detokenizer.py: incremental detokenization over a small window.
- responses.py: OpenAI response bodies and the renderers building them.
- scheduler_client.py: the grpc.aio client; the only module that touches protobuf.
- tenants.py: each request's tenant (from its API key, or a trusted header), set by ops.py's RequestGuard and
  the gRPC API, sent by scheduler_client.py in the GenerateRequest.
"""
