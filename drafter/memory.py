"""One memory for every drafter replica: learned segments go through a shared log, corpora into snapshots.

In: segments this replica learns (`learn`, the RequestStates sink), records the other replicas
publish (`poll`). Out: the planner's corpora, which hold both, and periodic snapshots.

- A segment learned here joins the local corpus at once and is appended to the log
  (drafter/segment_log.py); a failed append is kept and retried at the next poll, up to a bound.
- `poll` applies what the other replicas appended since the cursor. Each process has its own
  origin id, so a replica skips only its own records of this run; after a restart every record
  past the snapshot's cursor is replayed.
- `snapshot` writes every corpus and then the manifest with the cursor, each to a temporary file
  renamed over the old one, so a crash at any moment leaves complete files. A replica killed with
  kill -9 restarts from its last snapshot and replays the log after it: it loses nothing the log
  still holds. (A crash between the corpus renames and the manifest's replays a few segments
  twice, which only raises their counts.)

Tenants: a record carries the tenant whose request closed the segment, and every replica learns it
into that tenant's corpus (drafter/planner.py), so replicas stay scoped as the one that learned it.
A snapshot writes the shared corpora as `<segment>.corpus.npz` and each tenant's under
`tenants/<hex of the tenant id>/`; `restore` loads both. Corpus keys' corpora (drafter/keyed.py) go to
`keys/<hex of the key>.corpus.npz`, a tenant's under its own directory (`tenants/<hex>/keys/`), and
their records carry the key.

Learning itself goes through the planner: with a background learner (drafter/learner.py) a segment
is queued there, and `catch_up` and `snapshot` wait until the queue is applied (a snapshot must not
record a cursor past what its corpora hold).

Not thread-safe: the servicer calls learn/poll/snapshot under its one lock.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable, Mapping, Sequence

from drafter.corpus import LookupCorpus
from drafter.keyed import KeyedCorpora, Scope
from drafter.planner import DraftPlanner
from drafter.segments import CorpusLimits, SegmentsConfig
from drafter.segment_log import Cursor, LearnedSegment, SegmentLog

logger = logging.getLogger(__name__)
MANIFEST = "snapshot.json"
CORPUS_SUFFIX = ".corpus.npz"
TENANTS_DIR = "tenants"
KEYS_DIR = "keys"
MAX_UNPUBLISHED = 10_000


def corpus_path(directory: str | Path, segment: str) -> Path:
    return Path(directory) / f"{segment}{CORPUS_SUFFIX}"


def new_origin(replica: str = "") -> str:
    """A unique id for this process's records (the replica's name, when it has one, for readability)."""
    return f"{replica or 'drafter'}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class SharedMemory:
    """The planner's corpora, kept in step with the shared log and snapshotted to `snapshot_dir`."""

    def __init__(self, planner: DraftPlanner, log: SegmentLog | None, snapshot_dir: str | Path | None,
                 origin: str | None = None, log_name: str = "", cursor: Cursor = None,
                 redact: Callable[[Sequence[int]], Sequence[int]] | None = None):
        self.planner = planner
        self.redact = redact
        """Applied to every segment learned here before the corpus and the log see it (drafter/redaction.py)."""
        self.log = log
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.origin = origin or new_origin()
        self.log_name = log_name
        """Which log the cursor belongs to (a cursor of another log is not used)."""
        self.cursor = cursor
        self._unpublished: deque[LearnedSegment] = deque(maxlen=MAX_UNPUBLISHED)
        self.num_applied = 0
        """Records of other replicas applied so far."""

    def learn(self, segment: str, token_ids: Sequence[int], tenant: str = "", corpus_key: str = "") -> None:
        """A segment closed here (a keyed request's output, with its key): into the tenant's local corpus now, and
        onto the log for the others."""
        if self.redact is not None:
            token_ids = self.redact(token_ids)
        self.planner.learn(segment, token_ids, tenant, corpus_key)
        if self.log is not None:
            self._unpublished.append(LearnedSegment(self.origin, segment, tuple(token_ids), tenant, corpus_key))
            self._publish()

    def poll(self, max_records: int = 1000) -> int:
        """Retry unpublished records, then apply the others' new records. Returns how many were read."""
        if self.log is None:
            return 0
        self._publish()
        records, self.cursor = self.log.read(self.cursor, max_records)
        for record in records:
            if record.origin != self.origin:
                self.planner.learn(record.segment, record.token_ids, record.tenant, record.corpus_key)
                self.num_applied += 1
        return len(records)

    def catch_up(self, max_records: int = 1000) -> int:
        """Poll until the log has nothing new (at start-up, after restoring a snapshot). Returns records read."""
        total = 0
        while (read := self.poll(max_records)) > 0:
            total += read
        self.planner.wait_learned()
        return total

    def snapshot(self) -> Path | None:
        """Write every corpus, then the manifest with the cursor, atomically; returns the manifest's path."""
        if self.snapshot_dir is None:
            return None
        self.planner.wait_learned()
        with self.planner.reading():
            save_corpora(self.planner.corpora, self.snapshot_dir)
            save_tenant_corpora(self.planner.tenant_corpora, self.snapshot_dir)
            save_keyed_corpora(self.planner.keyed, self.snapshot_dir)
        manifest = {"log": self.log_name, "cursor": self.cursor, "origin": self.origin, "saved_at": time.time(),
                    "segments": sorted(self.planner.corpora)}
        path = self.snapshot_dir / MANIFEST
        _atomic(path, lambda p: Path(p).write_text(json.dumps(manifest)))
        return path

    def _publish(self) -> None:
        while self._unpublished:
            try:
                self.log.append(self._unpublished[0])
            except Exception as exc:  # the log is down: keep the record, drafting goes on
                logger.warning("cannot publish a learned segment (%d waiting): %s", len(self._unpublished), exc)
                return
            self._unpublished.popleft()


def load_corpora(segments: SegmentsConfig, directory: str | Path | None) -> dict[str, LookupCorpus]:
    """One corpus per segment kind: loaded from `directory` when saved there, else empty."""
    corpora = {}
    for kind in segments.all_kinds:
        path = corpus_path(directory, kind.name) if directory else None
        is_saved = path is not None and path.is_file()
        corpora[kind.name] = LookupCorpus.load(path, kind.corpus) if is_saved else LookupCorpus(kind.corpus)
    return corpora


def save_corpora(corpora: Mapping[str, LookupCorpus], directory: str | Path) -> None:
    """Write every corpus to `directory`, each atomically (a temporary file renamed over the old one)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, corpus in corpora.items():
        _atomic(corpus_path(directory, name), corpus.save)


def tenant_dir(directory: str | Path, tenant: str) -> Path:
    """Where a tenant's corpora are saved (the id hex-encoded: any tenant id is a safe file name)."""
    return Path(directory) / TENANTS_DIR / tenant.encode().hex()


def save_tenant_corpora(corpora: Mapping[tuple[str, str], LookupCorpus], directory: str | Path) -> None:
    """Write each (tenant, segment) corpus under `directory`/tenants/, atomically; remove the ones no longer held."""
    by_tenant: dict[str, dict[str, LookupCorpus]] = {}
    for (tenant, segment), corpus in corpora.items():
        by_tenant.setdefault(tenant, {})[segment] = corpus
    for tenant, tenant_corpora in by_tenant.items():
        save_corpora(tenant_corpora, tenant_dir(directory, tenant))
    root = Path(directory) / TENANTS_DIR
    kept = {tenant_dir(directory, tenant) / corpus_path("", segment).name for tenant, segment in corpora}
    for path in root.glob(f"*/*{CORPUS_SUFFIX}") if root.is_dir() else ():
        if path not in kept:  # a tenant corpus dropped for the budget since the last snapshot
            path.unlink(missing_ok=True)


def load_tenant_corpora(segments: SegmentsConfig, directory: str | Path | None
                        ) -> dict[tuple[str, str], LookupCorpus]:
    """The per-tenant corpora saved under `directory`/tenants/ (kinds still configured only)."""
    root = Path(directory) / TENANTS_DIR if directory else None
    if root is None or not root.is_dir():
        return {}
    corpora = {}
    for path in sorted(root.iterdir()):
        try:
            tenant = bytes.fromhex(path.name).decode()
        except ValueError:
            continue  # not one of ours
        for kind in segments.all_kinds:
            saved = corpus_path(path, kind.name)
            if saved.is_file():
                corpora[(tenant, kind.name)] = LookupCorpus.load(saved, kind.corpus)
    return corpora


def keys_dir(directory: str | Path, tenant: str) -> Path:
    """Where a tenant's keyed corpora are saved ("" = the shared ones)."""
    return (tenant_dir(directory, tenant) if tenant else Path(directory)) / KEYS_DIR


def save_keyed_corpora(keyed: KeyedCorpora, directory: str | Path) -> None:
    """Write each (tenant, key) corpus as <hex of the key>.corpus.npz under keys_dir, atomically; remove the ones no
    longer held."""
    kept = set()
    for (tenant, key), corpus in keyed.items():
        path = corpus_path(keys_dir(directory, tenant), key.encode().hex())
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(path, corpus.save)
        kept.add(path)
    for folder in _keyed_dirs(directory).values():
        for path in folder.glob(f"*{CORPUS_SUFFIX}"):
            if path not in kept:  # dropped for a bound since the last snapshot
                path.unlink(missing_ok=True)


def load_keyed_corpora(limits: CorpusLimits, directory: str | Path | None) -> dict[Scope, LookupCorpus]:
    """The keyed corpora saved under `directory`, with the schema kind's current limits."""
    corpora = {}
    for tenant, folder in _keyed_dirs(directory).items() if directory else ():
        for path in sorted(folder.glob(f"*{CORPUS_SUFFIX}")):
            try:
                key = bytes.fromhex(path.name[: -len(CORPUS_SUFFIX)]).decode()
            except ValueError:
                continue  # not one of ours
            corpora[(tenant, key)] = LookupCorpus.load(path, limits)
    return corpora


def _keyed_dirs(directory: str | Path) -> dict[str, Path]:
    """Tenant -> its keys directory, for those that exist."""
    found = {"": keys_dir(directory, "")}
    root = Path(directory) / TENANTS_DIR
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            found[bytes.fromhex(path.name).decode()] = path / KEYS_DIR
        except ValueError:
            continue
    return {tenant: path for tenant, path in found.items() if path.is_dir()}


def restore(directory: str | Path | None, segments: SegmentsConfig, log_name: str
            ) -> tuple[dict[str, LookupCorpus], Cursor]:
    """The corpora saved in `directory` (empty ones for kinds not saved) and the cursor of its manifest
    when it was taken on the same log (else None: replay the whole log)."""
    corpora = load_corpora(segments, directory)
    cursor = None
    manifest = Path(directory) / MANIFEST if directory else None
    if manifest is not None and manifest.is_file():
        saved = json.loads(manifest.read_text())
        cursor = saved.get("cursor") if saved.get("log") == log_name else None
    return corpora, cursor


def _atomic(path: Path, write) -> None:
    """Call write(temporary path) next to `path`, flush it to disk, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
