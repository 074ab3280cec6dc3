"""The recorder's overflow to local disk, for when the queue refuses writes.

In: batches of serialized chunks the queue did not take (Redis down, SQLite disk
full). Out: the same batches, oldest first, to replay once the queue is back.

Each batch is one file, `<ns>.spill`, of length-prefixed payloads, written to a
temporary name, fsynced and renamed: a file is whole or absent. The total size is
bounded; the writer drops (and counts) a batch that would not fit. Files left by
a previous run are replayed too. Only the recorder's writer thread calls this.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Sequence

_LENGTH = struct.Struct(">I")


class SpillDir:
    def __init__(self, path: str | Path, max_bytes: int):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self.num_bytes = sum(f.stat().st_size for f in self._files())
        """Bytes spilled and not yet replayed."""

    def __bool__(self) -> bool:
        return self.num_bytes > 0

    def write(self, payloads: Sequence[bytes]) -> bool:
        """Spill one batch; False (nothing written) when it would pass max_bytes."""
        data = b"".join(_LENGTH.pack(len(p)) + p for p in payloads)
        if self.num_bytes + len(data) > self.max_bytes:
            return False
        final = self.path / f"{time.time_ns():020d}.spill"
        temp = final.with_suffix(".tmp")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        self.num_bytes += len(data)
        return True

    def oldest(self) -> tuple[Path, list[bytes]] | None:
        """The oldest spilled batch, to put into the queue and then `remove`."""
        files = self._files()
        if not files:
            return None
        data, payloads, offset = files[0].read_bytes(), [], 0
        while offset < len(data):
            (length,) = _LENGTH.unpack_from(data, offset)
            payloads.append(data[offset + 4 : offset + 4 + length])
            offset += 4 + length
        return files[0], payloads

    def remove(self, path: Path) -> None:
        self.num_bytes -= path.stat().st_size
        path.unlink()

    def _files(self) -> list[Path]:
        return sorted(self.path.glob("*.spill"))
