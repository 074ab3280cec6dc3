"""The README and the docs site: the site builds with --strict (no broken link or anchor), the README stays a
front door (under 250 lines, every relative link resolving), and the examples marked runnable run.

An example is runnable when the line just before its fence is `<!-- runnable -->` (rendered by neither GitHub
nor mkdocs). The end-to-end test runs each one against a tiny stack serving the tiny model under the default
model's name, with `localhost:8000` (HTTP) and `localhost:8001` (gRPC) pointed at the stack: Python blocks with this
interpreter, bash blocks with bash. An example passes when it exits with 0, prints something and prints no
error. Examples whose output only a model that answers makes sensible (a tool call under tool_choice "auto")
are marked `<!-- runnable with the default model -->` instead: tests/e2e/test_default_model.py runs those, and
the README's chat example, against the default model itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from common.catalog import DEFAULT_MODEL
from tests.support.e2e_helpers import tiny_stack

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MKDOCS = Path(sys.executable).with_name("mkdocs")
MAX_README_LINES = 250
RUNNABLE_MARK = "<!-- runnable -->"
DEFAULT_MODEL_MARK = "<!-- runnable with the default model -->"
RUNNERS = {"python": [sys.executable, "-"], "bash": ["bash", "-euo", "pipefail", "-s"]}
SERVED_MODEL_NAME = DEFAULT_MODEL
EXAMPLE_TIMEOUT_S = 120
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


class Example(NamedTuple):
    path: Path
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def runnable_examples(path: Path, mark: str = RUNNABLE_MARK) -> list[Example]:
    """The fenced blocks of `path` whose fence follows a `mark` line."""
    lines = path.read_text().splitlines()
    examples = []
    for i, line in enumerate(lines):
        if line.strip() != mark:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert fence, f"{path}:{i + 1}: {mark} must sit just before a code fence"
        ticks, language = fence.groups()
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == ticks)
        examples.append(Example(path, i + 2, language, "\n".join(lines[i + 2:end]) + "\n"))
    return examples


ALL_EXAMPLES = [example for path in markdown_files() for example in runnable_examples(path)]


# --- the site and the README ---------------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "v2" / "index.html").is_file()


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) < MAX_README_LINES
    assert "make serve" in text and "make test" in text
    assert "client --HTTP/SSE--> router --gRPC--> scheduler" in text


def test_every_relative_link_in_the_readme_resolves():
    targets = [target for target in LINK.findall(README.read_text())
               if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target)]
    assert targets, "the README links to the docs"
    missing = [target for target in targets if not (REPO / target.split("#")[0]).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_runnable_examples_cover_every_api():
    by_file = {example.path.relative_to(REPO).as_posix() for example in ALL_EXAMPLES}
    assert {"README.md", "docs/api/http.md", "docs/api/v2.md", "docs/api/grpc.md",
            "docs/api/python-client.md"} <= by_file
    unsupported = [example.id for example in ALL_EXAMPLES if example.language not in RUNNERS]
    assert not unsupported, f"runnable examples must be one of {sorted(RUNNERS)}: {unsupported}"


def test_examples_are_found_by_their_mark(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n\n```python\nprint(1)\n```\n\n<!-- runnable -->\n```bash\necho hi\n```\n")
    assert runnable_examples(page) == [Example(page, 8, "bash", "echo hi\n")]
    page.write_text("<!-- runnable -->\n\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="just before a code fence"):
        runnable_examples(page)


# --- the examples, against a real stack ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    stack = tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"))
    stack.config.router = dataclasses.replace(stack.config.router, served_model_name=SERVED_MODEL_NAME)
    with stack:
        yield stack


def pointed_at(code: str, stack) -> str:
    """The example with the documented addresses replaced by the stack's."""
    http_address = stack.base_url.split("://", 1)[1]
    return code.replace("localhost:8000", http_address).replace("localhost:8001", stack.grpc_address)


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=[example.id for example in ALL_EXAMPLES])
def test_a_runnable_example_runs(example, stack):
    result = subprocess.run(RUNNERS[example.language], input=pointed_at(example.code, stack), cwd=REPO,
                            capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{example.id} failed:\n{output}"
    assert result.stdout.strip(), f"{example.id} printed nothing:\n{output}"
    assert '"error"' not in result.stdout and "Traceback" not in output, f"{example.id} reported an error:\n{output}"
