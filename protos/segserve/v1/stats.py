"""Drafter statistics contracts (drafter.proto's DrafterStats, scheduler.proto's DrafterReplicaStats). Torch-free.

The drafter answers GetStats with `DrafterStats` (its corpus sizes per segment
kind, the requests it tracks); the scheduler adds what it knows of each replica
(address, live or backing off) as `DrafterReplicaStats` in its own GetStats,
which the router shows on /status.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import drafter_pb2, scheduler_pb2


@dataclass(frozen=True)
class DrafterSourceStats:
    """How well one source of a segment kind predicted what the model wrote (drafter/planner.py's judging)."""

    source: str
    num_judged: int = 0
    num_matched: int = 0

    def to_pb(self) -> drafter_pb2.DrafterSourceStats:
        return drafter_pb2.DrafterSourceStats(source=self.source, num_judged=self.num_judged,
                                              num_matched=self.num_matched)

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DrafterSourceStats) -> DrafterSourceStats:
        return cls(pb.source, pb.num_judged, pb.num_matched)


@dataclass(frozen=True)
class DrafterSegmentStats:
    """One segment kind's corpus, and the tracked requests in that segment now."""

    segment: str
    num_corpus_entries: int = 0
    """Learned tokens held in the kind's lookup corpora."""
    num_corpus_bytes: int = 0
    """Memory of the corpora's arrays."""
    num_requests: int = 0
    num_learned_tokens: int = 0
    """Tokens learned into the kind's corpora since the drafter started."""
    sources: tuple[DrafterSourceStats, ...] = ()
    """Each of the kind's sources, judged online."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))

    def to_pb(self) -> drafter_pb2.DrafterSegmentStats:
        return drafter_pb2.DrafterSegmentStats(
            segment=self.segment, num_corpus_entries=self.num_corpus_entries,
            num_corpus_bytes=self.num_corpus_bytes, num_requests=self.num_requests,
            num_learned_tokens=self.num_learned_tokens, sources=[s.to_pb() for s in self.sources])

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DrafterSegmentStats) -> DrafterSegmentStats:
        return cls(pb.segment, pb.num_corpus_entries, pb.num_corpus_bytes, pb.num_requests, pb.num_learned_tokens,
                   tuple(DrafterSourceStats.from_pb(s) for s in pb.sources))


@dataclass(frozen=True)
class DrafterStats:
    """A drafter replica's answer to GetStats."""

    segments: tuple[DrafterSegmentStats, ...] = ()
    """Every configured segment kind, by name."""
    num_requests: int = 0
    """Requests whose state the drafter keeps."""
    num_draft_calls: int = 0
    """Draft calls answered since the drafter started."""
    cpu_seconds: float = 0.0
    """CPU time of the whole drafter process since it started."""
    backend: str = ""
    """The proposer: "segserve" or "suffix" (drafter.config.BACKENDS)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))

    def to_pb(self) -> drafter_pb2.DrafterStats:
        return drafter_pb2.DrafterStats(segments=[s.to_pb() for s in self.segments], num_requests=self.num_requests,
                                        num_draft_calls=self.num_draft_calls, cpu_seconds=self.cpu_seconds,
                                        backend=self.backend)

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DrafterStats) -> DrafterStats:
        return cls(tuple(DrafterSegmentStats.from_pb(s) for s in pb.segments), pb.num_requests, pb.num_draft_calls,
                   pb.cpu_seconds, pb.backend)


@dataclass(frozen=True)
class DrafterReplicaStats:
    """One drafter replica as the scheduler sees it."""

    address: str
    is_live: bool
    """False while it backs off after a failure."""
    stats: DrafterStats | None = None
    """Its GetStats answer; None when it did not answer in time."""

    def to_pb(self) -> scheduler_pb2.DrafterReplicaStats:
        pb = scheduler_pb2.DrafterReplicaStats(address=self.address, is_live=self.is_live)
        if self.stats is not None:
            pb.stats.CopyFrom(self.stats.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: scheduler_pb2.DrafterReplicaStats) -> DrafterReplicaStats:
        return cls(pb.address, pb.is_live, DrafterStats.from_pb(pb.stats) if pb.HasField("stats") else None)
