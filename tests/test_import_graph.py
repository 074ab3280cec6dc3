"""The import graph: a service package never imports another service package.

router/, scheduler/, worker/ and drafter/ are separate gRPC services; they talk
over the wire contracts in protos/, never through each other's Python. A
service may import itself, protos, the leaf modules segserve.checkpoint (model
resolution), segserve.discovery (replica addresses, rendezvous hashing),
segserve.blocking (where a servicer runs a blocking call: on its event loop or
in a thread), segserve.health (the gRPC health protocol and reflection), segserve.heap
(the garbage collector's start-up freeze), segserve.tls
(TLS credentials, secure ports and channels), segserve.reflow.redact (the
redaction of personal data, which the drafter applies to what it learns), and
anything outside this repository (stdlib, third-party). protos imports none of
the services nor segserve, and the leaf modules import no first-party module.

Every import counts, wherever it is written: module level, inside functions,
classes, `if TYPE_CHECKING:` and try blocks; `import x` and `from x import y`
(y counts as the module x.y when x/y.py or x/y/ exists); relative imports
resolved against the file's package; importlib.import_module / __import__ calls
with a literal module name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("router", "scheduler", "worker", "drafter")
# What a service may import from this repository besides itself (modules and their submodules).
SERVICE_ALLOWED = ("protos", "segserve.checkpoint", "segserve.discovery", "segserve.blocking", "segserve.health",
                   "segserve.heap", "segserve.tls", "segserve.reflow.redact")


@dataclass(frozen=True, order=True)
class Edge:
    path: str  # relative to the root, with forward slashes
    line: int
    importer: str  # the importing module
    imported: str  # the imported module, absolute

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} -> {self.imported}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of `from <level dots><name> import ...` written in `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level > len(package):
        return f"<relative import beyond the top level: {'.' * level}{name or ''}>"
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports_of(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file."""
    module = module_name(root, path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = resolve_relative(module, path.name == "__init__.py", node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                is_sub = alias.name != "*" and not base.startswith("<") and _is_module(root, submodule)
                found.append((node.lineno, submodule if is_sub else base))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def first_party(root: Path) -> set[str]:
    """Top-level packages of this repository: its directories with an __init__.py, and the known ones."""
    return {p.parent.name for p in root.glob("*/__init__.py")} | set(SERVICES) | {"protos", "segserve", "tests"}


def python_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def bad_edges(root: Path, paths: list[Path], is_allowed) -> list[Edge]:
    """Imports of first-party modules that is_allowed(importer, imported) refuses, and unresolvable ones."""
    ours = first_party(root)
    edges = set()
    for path in paths:
        importer = module_name(root, path)
        for line, imported in imports_of(root, path):
            if imported.startswith("<") or (imported.split(".")[0] in ours and not is_allowed(importer, imported)):
                edges.add(Edge(path.relative_to(root).as_posix(), line, importer, imported))
    return sorted(edges)


def cross_service_edges(root: Path) -> list[Edge]:
    """Every import by a service of a first-party module other than itself, protos and the shared leaf modules."""
    def is_allowed(importer: str, imported: str) -> bool:
        own = importer.split(".")[0]
        return within(imported, own) or any(within(imported, allowed) for allowed in SERVICE_ALLOWED)

    paths = [p for service in SERVICES if (root / service).is_dir() for p in python_files(root, service)]
    return bad_edges(root, paths, is_allowed)


def edges_into(root: Path, paths: list[Path], forbidden: tuple[str, ...]) -> list[Edge]:
    """Imports, in the given files, of modules under any of the forbidden top-level packages."""
    return bad_edges(root, paths, lambda importer, imported: imported.split(".")[0] not in forbidden)


def _report(edges: list[Edge]) -> str:
    return "\n".join(f"  {edge}" for edge in edges)


# --- the repository -------------------------------------------------------------------------------

def test_no_service_imports_another_service():
    edges = cross_service_edges(REPO)
    assert not edges, ("a service package imports another service package (allowed: itself, protos, "
                       "segserve.checkpoint, stdlib, third-party):\n" + _report(edges))


def test_protos_import_no_service_and_no_segserve():
    edges = edges_into(REPO, python_files(REPO, "protos"), SERVICES + ("segserve", "tests"))
    assert not edges, "protos/ imports a service or segserve:\n" + _report(edges)


def test_the_shared_segserve_modules_are_leaves():
    for leaf in ("blocking.py", "checkpoint.py", "discovery.py", "health.py", "heap.py", "tls.py", "reflow/redact.py"):
        edges = edges_into(REPO, [REPO / "segserve" / leaf], SERVICES + ("tests",))
        assert not edges, f"segserve/{leaf} imports a service:\n" + _report(edges)
    # A service importing segserve.checkpoint also runs segserve/__init__.py (and segserve.reflow.redact runs
    # segserve/reflow/__init__.py): they must pull in nothing.
    for package in ("segserve", "segserve/reflow"):
        init = ast.parse((REPO / package / "__init__.py").read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))], \
            f"{package}/__init__.py must stay free of imports"


# --- the checker itself, on a fake tree -----------------------------------------------------------

FAKE_TREE = {
    "router/__init__.py": "",
    "router/x.py": "from worker import y\n",
    "router/sub/__init__.py": "",
    "router/sub/deep.py": (
        "import os\n"
        "import numpy\n"
        "from protos.v1 import common_pb2\n"
        "from segserve.checkpoint import resolve_model\n"
        "from segserve import checkpoint\n"  # line 5
        "from . import sibling\n"
        "from ..x import thing\n"
        "def f():\n"
        "    import scheduler.engine\n"  # line 9: function level
        "    from drafter.types import DraftTree\n"  # line 10
        "class C:\n"
        "    if True:\n"
        "        from segserve import cli\n"  # line 13: segserve beyond checkpoint
        "try:\n"
        "    import segserve.launcher as launcher\n"  # line 15
        "except ImportError:\n"
        "    pass\n"
        "import importlib\n"
        "importlib.import_module('worker.server')\n"  # line 19
        "from .... import too_far\n"  # line 20
        "import segserve\n"  # line 21: the package is not the leaf module
    ),
    "router/sub/sibling.py": "",
    "worker/__init__.py": "",
    "worker/y.py": "from router.app import create_app\nfrom . import y\n",
    "drafter/__init__.py": "",
    "drafter/z.py": "import tests.fake_spec\n",
    "scheduler/__init__.py": "",
    "segserve/__init__.py": "",
    "segserve/checkpoint.py": "import os\n",
    "segserve/cli.py": "",
    "protos/__init__.py": "from router import app\n",
    "protos/v1/__init__.py": "",
    "protos/v1/common_pb2.py": "from protos.v1 import common_pb2\n",
    "tests/__init__.py": "",
}


def _fake_tree(root: Path) -> Path:
    for name, text in FAKE_TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_deliberately_bad_edge_is_reported_with_file_and_line(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "router").mkdir()
    (root / "router" / "__init__.py").write_text("")
    (root / "router" / "x.py").write_text("from worker import y\n")
    (root / "worker").mkdir()
    (root / "worker" / "__init__.py").write_text("")
    (root / "worker" / "y.py").write_text("")
    assert [str(e) for e in cross_service_edges(root)] == ["router/x.py:1: router.x -> worker.y"]


def test_the_checker_sees_every_import_form(tmp_path):
    edges = [str(edge) for edge in cross_service_edges(_fake_tree(tmp_path))]
    expected = [
        "drafter/z.py:1: drafter.z -> tests.fake_spec",  # first party, not allowed
        "router/sub/deep.py:9: router.sub.deep -> scheduler.engine",
        "router/sub/deep.py:10: router.sub.deep -> drafter.types",
        "router/sub/deep.py:13: router.sub.deep -> segserve.cli",
        "router/sub/deep.py:15: router.sub.deep -> segserve.launcher",
        "router/sub/deep.py:19: router.sub.deep -> worker.server",
        "router/sub/deep.py:20: router.sub.deep -> <relative import beyond the top level: ....>",
        "router/sub/deep.py:21: router.sub.deep -> segserve",
        "router/x.py:1: router.x -> worker.y",
        "worker/y.py:1: worker.y -> router.app",
    ]
    # Not reported: stdlib, third-party, protos, segserve.checkpoint (both spellings), relative
    # imports within the service (lines 6, 7; worker/y.py:2).
    assert edges == expected


def test_protos_and_checkpoint_checks_report_a_service_import(tmp_path):
    root = _fake_tree(tmp_path)
    edges = edges_into(root, python_files(root, "protos"), SERVICES + ("segserve", "tests"))
    assert [str(e) for e in edges] == ["protos/__init__.py:1: protos -> router"]
    (root / "segserve" / "checkpoint.py").write_text("def f():\n    from worker.config import WorkerConfig\n")
    edges = edges_into(root, [root / "segserve" / "checkpoint.py"], SERVICES + ("tests",))
    assert [str(e) for e in edges] == ["segserve/checkpoint.py:2: segserve.checkpoint -> worker.config"]


def test_relative_imports_resolve_against_the_package():
    assert resolve_relative("router.reflow.gateway", False, 1, "chunks") == "router.reflow.chunks"
    assert resolve_relative("router.reflow.gateway", False, 2, "generation") == "router.generation"
    assert resolve_relative("router.reflow", True, 1, "queue") == "router.reflow.queue"
    assert resolve_relative("router.reflow", True, 2, None) == "router"
    assert resolve_relative("router.x", False, 2, "worker").startswith("<relative import beyond")
