"""Start the drafter: segments + corpora in, a grpc.aio server out; corpora saved at shutdown.

Corpora live in `corpus_dir` as `<segment>.corpus.npz` (drafter/corpus.py's format).
Draft models are handed in by the caller (`draft_models`, segment name ->
ContinuationSource), built by the draft-model loader from each segment's spec.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import grpc

from drafter.config import DrafterConfig
from drafter.corpus import LookupCorpus
from drafter.history import HistorySource
from drafter.planner import DraftPlanner
from drafter.segments import SegmentsConfig, load_segments
from drafter.service import DrafterServicer
from drafter.state import RequestStates
from drafter.types import ContinuationSource
from protos.segserve.v1 import drafter_pb2_grpc
from segserve.checkpoint import resolve_model

logger = logging.getLogger(__name__)
CORPUS_SUFFIX = ".corpus.npz"


def corpus_path(corpus_dir: str | Path, segment: str) -> Path:
    return Path(corpus_dir) / f"{segment}{CORPUS_SUFFIX}"


def load_corpora(segments: SegmentsConfig, corpus_dir: str | Path | None) -> dict[str, LookupCorpus]:
    """One corpus per segment kind: loaded from corpus_dir when saved there, else empty."""
    corpora = {}
    for kind in segments.all_kinds:
        path = corpus_path(corpus_dir, kind.name) if corpus_dir else None
        is_saved = path is not None and path.is_file()
        corpora[kind.name] = LookupCorpus.load(path, kind.corpus) if is_saved else LookupCorpus(kind.corpus)
    return corpora


def save_corpora(corpora: Mapping[str, LookupCorpus], corpus_dir: str | Path) -> None:
    Path(corpus_dir).mkdir(parents=True, exist_ok=True)
    for name, corpus in corpora.items():
        corpus.save(corpus_path(corpus_dir, name))


def load_tokenizer(tokenizer_dir: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(tokenizer_dir)))


def load_draft_models(segments: SegmentsConfig, target_dir: str | None, device: str = "cpu", dtype: str = "float32"
                      ) -> dict[str, ContinuationSource]:
    """The draft model of every segment kind that configures one (self-speculative ones share the target's weights),
    on `device` with `dtype` weights ("auto": cuda and bfloat16 when a GPU is present, else cpu and float32)."""
    import torch

    from drafter.draft_model import load_draft_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    target = str(resolve_model(target_dir))
    return {kind.name: load_draft_model(kind.draft_model.loader_spec(target), device, getattr(torch, dtype))
            for kind in segments.all_kinds if kind.draft_model is not None}


def build_servicer(
    config: DrafterConfig, segments: SegmentsConfig, draft_models: Mapping[str, ContinuationSource] | None = None
) -> DrafterServicer:
    """Planner (corpora loaded from config.corpus_dir) + request states wired for online learning."""
    planner = DraftPlanner(segments, load_corpora(segments, config.corpus_dir), draft_models)
    states = RequestStates(
        segments,
        on_segment_closed=planner.learn,
        max_requests=config.max_requests,
        history_factory=lambda: HistorySource(config.history_max_key, config.history_min_key),
    )
    return DrafterServicer(planner, states)


async def start_server(servicer: DrafterServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Bind and start a grpc.aio server; returns it and the bound port (port 0 = any free one)."""
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the drafter to {host}:{port}")
    await server.start()
    return server, bound


async def serve(config: DrafterConfig, draft_models: Mapping[str, ContinuationSource] | None = None) -> None:
    """Load segments and corpora, serve until stopped, then save the corpora to corpus_dir."""
    segments = load_segments(config.segments_config, load_tokenizer(config.tokenizer))
    if draft_models is None:
        draft_models = load_draft_models(segments, config.tokenizer, config.device, config.dtype)
    servicer = build_servicer(config, segments, draft_models)
    server, port = await start_server(servicer, config.host, config.port)
    logger.info("drafter listening on %s:%d with segments %s", config.host, port,
                [k.name for k in segments.all_kinds])
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1.0)
        if config.corpus_dir:
            save_corpora(servicer.planner.corpora, config.corpus_dir)
