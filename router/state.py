"""What every route needs, built once per app: `RouterState`, fetched per request by a dependency.

create_app (app.py) builds one RouterState and stores it on `app.state.router`;
routes (openai_routes.py, v2.py, tokenize_routes.py, status.py, ops.py) declare a
`state: StateDep` parameter and FastAPI hands them that object (`get_state`); the
gRPC API (grpc_api.py) is given the same object. So the routes are plain
APIRouter functions, and a test can build an app around any client, tokenizer
and model facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from protos.segserve.v1.info import WorkerInfo
from router.config import RouterConfig
from router.detokenizer import TokenTexts, segment_marker_ids
from router.drain import Drain
from router.errors import bad_request, model_not_found

if TYPE_CHECKING:
    from router.metrics import RouterMetrics
    from router.reflow.recorder import Recorder
    from router.scheduler_client import SchedulerApi


@dataclass
class RouterState:
    """One app's dependencies: its config, scheduler client, tokenizer and served model."""

    config: RouterConfig
    scheduler: SchedulerApi
    """The schedulers: generation (each request watched by a metrics.RequestTracker), readiness and stats."""
    metrics: RouterMetrics
    tokenizer: Any
    model_info: WorkerInfo
    """The worker's facts, from the scheduler's GetInfo."""
    served_name: str
    """The model name clients send."""
    created: int
    """Unix time the app was built (the model card's `created`)."""
    recorder: Recorder | None = None
    """Data reflow's recorder, when configured."""
    drain: Drain = field(default_factory=Drain)
    """Graceful shutdown: set draining on SIGTERM (server.py); /ready and DrainGuard read it."""
    token_texts: TokenTexts = field(init=False)
    eos_token_ids: frozenset[int] = field(init=False)
    hidden_token_ids: frozenset[int] = field(init=False)
    """Tokens left out of the text users see: the segment markers, when config.is_strip_segment_markers."""

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.tokenizer)
        self.eos_token_ids = frozenset(self.model_info.eos_token_ids)
        self.hidden_token_ids = segment_marker_ids(self.tokenizer) if self.config.is_strip_segment_markers \
            else frozenset()

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is None or the served model's name."""
        if model is not None and model != self.served_name:
            raise model_not_found(model)

    def decode(self, token_ids: list[int], param: str, skip_special_tokens: bool = False) -> str:
        """The text of a client's token ids (/detokenize, gRPC Detokenize); a 400 naming `param` for an id outside
        the vocabulary."""
        vocab_size = self.model_info.vocab_size
        bad = next((token for token in token_ids if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise bad_request(f"Invalid request: `{param}` holds id {bad}, outside the vocabulary of {vocab_size}",
                              param)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


async def get_state(request: Request) -> RouterState:
    """The FastAPI dependency giving a route its app's RouterState (async: FastAPI would run a plain function in
    its thread pool, a thread hand-off on every request)."""
    return request.app.state.router


StateDep = Annotated[RouterState, Depends(get_state)]
