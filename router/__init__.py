"""The router: the front door of segserve. Text in over HTTP and gRPC, token ids out to the scheduler.

In: HTTP requests (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/v2/models/{model}/generate[_stream], /health, /ready, /metrics, /status, /playground) and the public gRPC API
(segserve.v1.Generation: Generate, GenerateStream, Tokenize, Detokenize, ListModels).
Out: one contract `GenerateRequest` (token ids, sampling, stopping, tenant) per choice, sent to a scheduler over
gRPC (`SchedulerApi.open`); its token stream comes back, is detokenized incrementally and is answered as JSON,
SSE or gRPC messages. On the side: Prometheus metrics, and each request and answer recorded for data reflow.

Modules, from the wire inwards:
- server.py: run() / build_app(): tokenizer, scheduler pool, uvicorn and the gRPC API on one loop;
  config.py: RouterConfig; drain.py: graceful shutdown.
- app.py: create_app() assembles the app from the route modules around one RouterState (state.py, fetched
  by a FastAPI dependency).
- guard.py: the middleware in front of every route: API keys, tenants, body size.
- openai_routes.py, v2.py, tokenize_routes.py, status.py, ops.py: the /v1, /v2, /(de)tokenize, /status and
  /health, /ready, /metrics routes (APIRouters); grpc_api.py + grpc_convert.py: the public gRPC API.
- protocol.py: OpenAI request bodies (pydantic, types only) and their mapping onto the
  contract (protos/segserve/v1: SamplingParams, StoppingCriteria, GenerateRequest).
- structured.py: structured outputs (response_format, vLLM's structured_outputs / guided_*) onto the contract's
  StructuredOutput, and the edge's bounded, cached check that the schema, regex or grammar compiles (xgrammar).
- schema_engines.py: a JSON schema enforced exactly, by xgrammar or llguidance, or the 400 naming each construct
  neither enforces and its JSON pointer.
- output_validation.py: every finished JSON output validated against its schema; one that fails ends "error".
- tools.py: tool calling (tools into the chat template, tool_choice forced by a grammar, a choice's text read
  as tool_calls); tool_parsers.py: the model formats a tool call is read from (--tool-call-parser), over
  json_stream.py's JSON read a character at a time.
- prompts.py: prompt / chat template to token ids, and the output budget (max_tokens) every edge computes once.
- admission.py: the contract's validate_request on every request, and the context check, as a 400 naming the
  field.
- errors.py: OpenAI-shaped errors; bad input is always a 4xx naming the field.
- serving.py: running jobs and answering with JSON or SSE (keep-alives, disconnects); choices.py, stop.py: n
  choices merged, stop strings cut.
- generation.py: one request's event stream as text deltas (+ keep-alive ticks), its observers told of each event.
- detokenizer.py: incremental detokenization over a small window; responses.py: OpenAI response bodies;
  speculation.py: the opt-in per-token `segserve` extension of stream chunks.
- metrics.py: the Prometheus metrics (a RequestTracker observes each request's stream).
- scheduler_client.py: `SchedulerApi`, the one interface to schedulers, and its gRPC client of one scheduler;
  scheduler_streams.py: requests on the shared GenerateStreams call; scheduler_pool.py: several schedulers.
- traces.py: each generation request's span (HTTP middleware, the gRPC API), its context sent in the
  GenerateRequest (common/tracing.py; nothing when tracing is off).
- tenants.py: each request's tenant (from its API key, or a trusted header), set by guard.py and the gRPC API,
  sent by scheduler_client.py in the GenerateRequest.
- reflow/: data reflow's recording (middleware, delta recorder, durable queue).
"""
