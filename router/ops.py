"""The router's operations routes: liveness, readiness and Prometheus metrics.

In: the app's RouterState (state.py). Out: `router`, an APIRouter with
- GET /health: liveness, 200 while this process serves.
- GET /ready: 200 once the scheduler reports its worker loaded and warmed up by a
  real forward (the worker's Health), else 503 with the reason; 503 from the
  router's SIGTERM on (drain.py).
- GET /metrics: the exposition text of the state's RouterMetrics (metrics.py), with the
  scheduler's stats read at the scrape.
The API keys and body limit in front of these routes are guard.py's.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from router.state import StateDep

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "Not ready yet", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"const": "not_ready"}, "reason": {"type": "string"}},
    "required": ["status", "reason"]}}}}})
async def ready(state: StateDep) -> JSONResponse:
    if state.drain.is_draining:
        return JSONResponse({"status": "not_ready", "reason": "shutting down"}, status_code=503)
    health = await state.scheduler.health()
    if health.is_ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not_ready", "reason": health.detail or "the worker is not ready"},
                        status_code=503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics_text(state: StateDep) -> Response:
    return Response(await state.metrics.render(state.scheduler), media_type=CONTENT_TYPE_LATEST)
