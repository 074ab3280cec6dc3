"""The default model's one-time conversion when several processes ask for it at once."""

from __future__ import annotations

import threading
import time

from common import checkpoint


def test_concurrent_preparers_convert_once_and_all_get_the_finished_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "models" / "gemma-3-270m"
    conversions, inside, overlaps = [], [], []

    def slow_convert(path):  # what _convert leaves: files, then the marker, written over a while
        inside.append(path)
        if len(inside) > 1:
            overlaps.append(len(inside))
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"weights")
        time.sleep(0.3)
        (path / checkpoint._DONE_MARKER).write_text("ok\n")
        conversions.append(path)
        inside.remove(path)

    monkeypatch.setattr(checkpoint, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(checkpoint.prepare_default_model(target)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [target] * 4
    assert conversions == [target] and overlaps == []
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert checkpoint.prepare_default_model(target) == target and len(conversions) == 1  # done: no lock, no work
