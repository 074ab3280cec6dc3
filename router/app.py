"""create_app: the router's FastAPI app, assembled from its route modules around one RouterState.

Routes: the OpenAI-compatible /v1 routes (openai_routes.py), the MindIE-style
/v2/models/{model}/generate[_stream] routes (v2.py), GET /health, /ready,
/metrics (ops.py), GET /status (status.py: the live view's JSON), POST /tokenize and /detokenize and
GET /tokenizer_info (tokenize_routes.py), and the browser playground at GET /playground (playground/). They
share nothing but the `RouterState` built here (config, scheduler client, tokenizer, model facts, metrics,
reflow recorder) and fetched by a FastAPI dependency (state.py); the running of a generation is serving.py's.
Middleware, outermost first: the request span when tracing is on (traces.py), the
request guard (API keys, body limit; guard.py), then data reflow's recording when
configured (reflow/gateway.py), then the drain guard (drain.py: requests under way
counted, new ones refused once shutting down).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from protos.segserve.v1.info import WorkerInfo
from router import openai_routes, ops, playground, status, tokenize_routes, v2
from router.config import RouterConfig
from router.drain import DrainGuard
from router.errors import ERROR_RESPONSES, install_error_handlers
from router.guard import RequestGuard
from router.metrics import RouterMetrics
from router.reflow import RecorderConfig, open_recorder
from router.reflow.gateway import ReflowCollector, ReflowMiddleware
from router.scheduler_client import SchedulerApi
from router.state import RouterState
from router.traces import TraceMiddleware
from common import tracing


def create_app(config: RouterConfig, client: SchedulerApi, tokenizer, model_info: WorkerInfo) -> FastAPI:
    """The router's FastAPI app, serving `model_info`'s model through `client`."""
    state = build_state(config, client, tokenizer, model_info)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.close()
        if state.recorder is not None:
            state.recorder.close()  # flushes what is still in memory

    app = FastAPI(title="segserve router", lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.router = state
    app.state.metrics_registry = state.metrics.registry  # for other collectors
    install_error_handlers(app)
    app.add_middleware(DrainGuard, drain=state.drain)  # innermost: a refusal is recorded like any answer
    if state.recorder is not None:  # added before the guard, so it runs inside it
        app.add_middleware(ReflowMiddleware, recorder=state.recorder, service_id=state.served_name)
        state.metrics.registry.register(ReflowCollector(state.recorder))
    app.add_middleware(RequestGuard, api_keys=config.api_keys, max_body_bytes=config.max_request_body_bytes,
                       tenant_header=config.tenant_header, is_metrics_key_required=config.metrics_require_key)
    if tracing.is_enabled():  # outermost: a request the guard refuses is traced too
        app.add_middleware(TraceMiddleware)
    app.include_router(ops.router)
    app.include_router(openai_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(v2.router_for(state.served_name))
    app.include_router(status.router)
    app.include_router(playground.router)
    return app


def build_state(config: RouterConfig, client: SchedulerApi, tokenizer, model_info: WorkerInfo) -> RouterState:
    """Everything the routes share; opens the reflow recorder when `config` asks for one."""
    served_name = config.served_model_name or model_info.model_name
    recorder = None
    if config.reflow_queue_url:
        recorder = open_recorder(RecorderConfig(queue_url=config.reflow_queue_url, spill_dir=config.reflow_spill_dir))
    return RouterState(config=config, scheduler=client, metrics=RouterMetrics(served_name), tokenizer=tokenizer,
                       model_info=model_info, served_name=served_name, created=int(time.time()), recorder=recorder)
