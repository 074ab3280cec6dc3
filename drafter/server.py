"""Start the drafter: segments + corpora in, a grpc.aio server out; corpora shared and snapshotted.

Learned segments join the corpora on a background thread (drafter/learner.py), so Draft calls
answer within their deadline while a long segment is learned or a corpus evicts.
Corpora are snapshotted to `corpus_dir` as `<segment>.corpus.npz` (drafter/corpus.py's format) with
a manifest, periodically and at shutdown; learned segments are shared with the other replicas
through a log (drafter/memory.py, drafter/segment_log.py).
Draft models are handed in by the caller (`draft_models`, segment name ->
ContinuationSource), built by the draft-model loader from each segment's spec.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any, Mapping

import grpc

from drafter.config import DrafterConfig
from drafter.history import HistorySource
from drafter.learner import Learner
from drafter.memory import SharedMemory, load_keyed_corpora, load_tenant_corpora, new_origin, restore
from drafter.planner import DraftPlanner
from drafter.redaction import SegmentRedactor
from drafter.segment_log import DirectorySegmentLog, RedisSegmentLog, SegmentLog
from drafter.segments import SegmentsConfig, load_segments
from drafter.service import DrafterServicer
from drafter.state import RequestStates
from drafter.suffix import SuffixPlanner
from drafter.types import ContinuationSource
from protos.segserve.v1 import drafter_pb2_grpc
from common import tracing
from common.checkpoint import resolve_model
from common.health import start_serving
from common.heap import freeze_startup_heap
from common.ports import announce_ports
from common.tls import EXCLUSIVE_PORT, TlsFiles, internal_tls

logger = logging.getLogger(__name__)


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
    """Planner (corpora restored from config.corpus_dir) + request states wired for online learning through the
    shared memory (its log from the config; the log is not read yet: serve() catches up before serving). Backend
    suffix: SuffixDecoding's trees over the same request states, no corpora, log or draft models."""
    if config.backend == "suffix":
        return suffix_servicer(config, segments)
    origin = new_origin(config.replica_name or socket.gethostname())
    log, log_name = open_segment_log(config, origin)
    corpora, cursor = restore(config.corpus_dir, segments, log_name)
    planner = DraftPlanner(segments, corpora, draft_models, Learner(), load_tenant_corpora(segments, config.corpus_dir),
                           config.max_corpus_keys, load_keyed_corpora(segments.schema.corpus, config.corpus_dir))
    redact = SegmentRedactor(load_tokenizer(config.tokenizer)) if config.redact_corpora else None
    memory = SharedMemory(planner, log, config.corpus_dir, origin, log_name, cursor, redact)
    states = RequestStates(
        segments,
        on_segment_closed=memory.learn,
        max_requests=config.max_requests,
        history_factory=lambda: HistorySource(config.history_max_key, config.history_min_key,
                                              max_bytes=config.history_max_bytes),
        max_history_bytes=config.history_total_bytes,
    )
    return DrafterServicer(planner, states, memory)


def suffix_servicer(config: DrafterConfig, segments: SegmentsConfig) -> DrafterServicer:
    """The suffix backend: its planner learns every request's tokens itself, so the states index no history and
    learn no segments."""
    planner = SuffixPlanner(segments, config)
    states = RequestStates(segments, on_segment_closed=lambda *args, **kwargs: None, max_requests=config.max_requests,
                           history_factory=lambda: HistorySource(is_indexed=False))
    return DrafterServicer(planner, states)


def open_segment_log(config: DrafterConfig, origin: str) -> tuple[SegmentLog | None, str]:
    """The shared log the config names, and a name for it that snapshots record ("" = none); a directory log
    writes this process's records (origin) to a file of its own."""
    if config.redis_url:
        return RedisSegmentLog(config.redis_url, config.redis_stream), f"redis:{config.redis_stream}"
    directory = config.shared_log_dir or (str(Path(config.corpus_dir) / "log") if config.corpus_dir else None)
    if directory is None:
        return None, ""
    return DirectorySegmentLog(directory, origin), "directory"


async def keep_memory(servicer: DrafterServicer, config: DrafterConfig) -> None:
    """Forever: apply the others' segments every log_poll_interval_s, snapshot every snapshot_interval_s."""
    loop = asyncio.get_running_loop()
    next_snapshot = loop.time() + config.snapshot_interval_s
    while True:
        await asyncio.sleep(config.log_poll_interval_s)
        try:
            await servicer.sync_memory()
            if loop.time() >= next_snapshot:
                next_snapshot = loop.time() + config.snapshot_interval_s
                await servicer.snapshot()
        except Exception:  # the log or the disk failed: drafting goes on, the next round retries
            logger.warning("keeping the shared memory failed", exc_info=True)


async def start_server(servicer: DrafterServicer, host: str, port: int,
                       tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """Bind and start a grpc.aio server with the Drafter, the standard health service (servicer.health: SERVING
    once started) and reflection; returns it and the bound port (port 0 = any free one). With `tls`
    (common.tls.internal_tls of the config), clients must present a certificate its CA signed."""
    server = grpc.aio.server(options=[EXCLUSIVE_PORT])
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = await start_serving(server, servicer.serving, f"{host}:{port}", tls, "the drafter")
    await servicer.set_serving(True)
    return server, bound


async def serve(config: DrafterConfig, draft_models: Mapping[str, ContinuationSource] | None = None) -> None:
    """Load segments and corpora, serve until stopped, then save the corpora to corpus_dir."""
    tls = internal_tls(config)
    if tls is not None:
        tls.check()  # before the slow loading
    segments = load_segments(config.segments_config, load_tokenizer(config.tokenizer))
    if draft_models is None and config.backend == "segserve":
        draft_models = load_draft_models(segments, config.tokenizer, config.device, config.dtype)
    servicer = build_servicer(config, segments, draft_models)
    num_replayed = await asyncio.to_thread(servicer.memory.catch_up) if servicer.memory is not None else 0
    tracing.setup("drafter", config)
    server, port = await start_server(servicer, config.host, config.port, tls)
    announce_ports(port=port)
    freeze_startup_heap()  # segments, tokenizer, draft models and the replayed corpora
    logger.info("drafter listening on %s:%d%s with segments %s, the %s backend (%d log records replayed)",
                config.host, port, " (mutual TLS)" if tls else "", [k.name for k in segments.all_kinds], config.backend,
                num_replayed)
    keeper = asyncio.create_task(keep_memory(servicer, config))
    try:
        await server.wait_for_termination()
    finally:
        keeper.cancel()
        await servicer.set_serving(False)
        await server.stop(grace=1.0)
        if servicer.memory is not None:
            servicer.memory.snapshot()  # SIGTERM and Ctrl-C end here too (it waits for queued learning)
            servicer.memory.planner.learner.close()
            if servicer.memory.log is not None:
                servicer.memory.log.close()
        tracing.shutdown()
