"""The layers, as pyproject.toml's import-linter contracts declare them, and no import cycle anywhere.

protos/ and common/ are the bottom; router/, scheduler/, worker/ and drafter/ sit on them, independent of
each other; segserve/ (CLI, launcher, benchmarks, offline tools, the public client) is the top. The
contracts are the one source of truth: these tests run the tool on them, and show that it fails on a
deliberately bad edge, so a contract that stopped matching anything would not pass unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "common", "router", "scheduler", "worker", "drafter", "segserve")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def copy_of_the_project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", root)
    return root


def test_the_layer_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("path, code, edge", [
    ("worker/misplaced.py", "from segserve import launcher\n", "worker.misplaced -> segserve.launcher"),
    ("drafter/misplaced.py", "def later():\n    from scheduler import engine\n",
     "drafter.misplaced -> scheduler.engine"),
    ("segserve/client/misplaced.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
     "segserve.client.misplaced -> torch"),
], ids=["a service imports the CLI", "a service imports another", "the client imports torch"])
def test_a_bad_edge_breaks_a_contract(tmp_path, path, code, edge):
    root = copy_of_the_project(tmp_path)
    (root / path).write_text(code)
    result = lint_imports(root)
    assert result.returncode != 0
    assert edge in result.stdout


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.find_modules_directly_imported_by(successor)))))
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    assert import_cycles(graph) == []


def test_a_cycle_through_a_type_checking_import_is_found(tmp_path, monkeypatch):
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop import b\n")
    (package / "b.py").write_text("from loop import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop.a import x\n")
    (package / "d.py").write_text("from loop import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("loop", exclude_type_checking_imports=False, cache_dir=None)
    assert import_cycles(graph) == [["loop.a", "loop.b", "loop.c"]]
