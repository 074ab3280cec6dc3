"""Where inference logs land: one file per session, its turns in order.

In: records (assembly.build_record), any number of sessions at once. Out: for each
session, `<sink_dir>/<session>.jsonl` (one turn per line) or `.parquet` (one turn
per row), ordered by the time each request started.

Writes are idempotent and atomic, which is what makes a killed consumer harmless:
a session's file is read, merged with the new records by request id, written to a
temporary file, fsynced and renamed over the old one. Writing a record again (a
redelivery, a restart after a kill between write and ack) changes nothing. When
two versions of one request meet, the fuller wins: a finished record beats an
"incomplete" one, then more chunks beat fewer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_JSON_COLUMNS = ("request", "usage", "other_choices")  # nested values, stored as JSON text in Parquet


class SessionSink(ABC):
    suffix: str

    def __init__(self, sink_dir: str | Path):
        self.sink_dir = Path(sink_dir)
        self.sink_dir.mkdir(parents=True, exist_ok=True)

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        by_session: dict[str, list[dict]] = defaultdict(list)
        for record in records:
            by_session[record["session_id"]].append(record)
        for session_id, new in by_session.items():
            path = self.path_for(session_id)
            merged = merge_turns(self._read(path) if path.exists() else [], new)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            self._write(temp, merged)
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temp, path)

    def path_for(self, session_id: str) -> Path:
        name = session_id
        if not _SAFE_NAME.fullmatch(session_id):  # a client's X-Session-Id may be anything
            name = "h-" + hashlib.sha256(session_id.encode()).hexdigest()[:32]
        return self.sink_dir / f"{name}{self.suffix}"

    def sessions(self) -> Iterator[list[dict[str, Any]]]:
        """Every session's turns, in order."""
        for path in sorted(self.sink_dir.glob(f"*{self.suffix}")):
            yield self._read(path)

    @abstractmethod
    def _read(self, path: Path) -> list[dict[str, Any]]: ...

    @abstractmethod
    def _write(self, path: Path, records: list[dict[str, Any]]) -> None: ...


class JsonlSink(SessionSink):
    suffix = ".jsonl"

    def _read(self, path: Path) -> list[dict[str, Any]]:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def _write(self, path: Path, records: list[dict[str, Any]]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


class ParquetSink(SessionSink):
    suffix = ".parquet"

    def _read(self, path: Path) -> list[dict[str, Any]]:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        for row in rows:
            for column in _JSON_COLUMNS:
                row[column] = json.loads(row[column]) if column in row else None  # older logs lack a column
        return rows

    def _write(self, path: Path, records: list[dict[str, Any]]) -> None:
        write_parquet(path, records)


def write_parquet(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Records as Parquet rows (nested request/usage as JSON text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**r, **{c: json.dumps(r.get(c), ensure_ascii=False) for c in _JSON_COLUMNS}} for r in records]
    pq.write_table(pa.Table.from_pylist(rows), path)


def open_sink(sink_dir: str | Path, sink_format: str = "jsonl") -> SessionSink:
    return {"jsonl": JsonlSink, "parquet": ParquetSink}[sink_format](sink_dir)


def merge_turns(existing: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per request id (the fuller one), ordered by start time."""
    by_id = {record["request_id"]: record for record in existing}
    for record in new:
        kept = by_id.get(record["request_id"])
        if kept is None or _fullness(record) > _fullness(kept):
            by_id[record["request_id"]] = record
    return sorted(by_id.values(), key=lambda r: (r["started_at"], r["request_id"]))


def _fullness(record: dict[str, Any]) -> tuple[bool, int]:
    return record["finish"] != "incomplete", record["num_chunks"]
