"""The SuffixDecoding-style peer workloads: recorded files match the generator, splits stay apart. No model."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from segserve.bench.peer_workloads import DATA_DIR, MAX_PROMPT_CHARS, PEER_KINDS, generate, load, write_all


@pytest.mark.parametrize("kind", PEER_KINDS)
def test_recorded_file_is_what_generate_makes(kind):
    assert load(kind) == generate(kind), f"regenerate with python -m segserve.bench.peer_workloads ({kind})"


@pytest.mark.parametrize("kind", PEER_KINDS)
def test_warmup_comes_first_and_heldout_sessions_are_new(kind):
    requests = generate(kind)
    splits = [request["split"] for request in requests]
    assert splits == ["warmup"] * splits.count("warmup") + ["heldout"] * splits.count("heldout")
    assert 5 <= splits.count("warmup") <= 8 and 5 <= splits.count("heldout") <= 8
    warmup = [request for request in requests if request["split"] == "warmup"]
    heldout = [request for request in requests if request["split"] == "heldout"]
    assert not {r["session"] for r in warmup} & {r["session"] for r in heldout}
    assert not {r["prompt"] for r in warmup} & {r["prompt"] for r in heldout}
    assert [request["seed"] for request in requests] == sorted({request["seed"] for request in requests})


@pytest.mark.parametrize("kind", PEER_KINDS)
def test_sessions_run_turn_by_turn_within_the_size_bound(kind):
    requests = generate(kind)
    for request in requests:
        assert request["kind"] == kind and 0 < len(request["prompt"]) <= MAX_PROMPT_CHARS
        assert request["max_tokens"] in (48, 64)
    sessions: dict[int, list[dict]] = {}
    for request in requests:
        sessions.setdefault(request["session"], []).append(request)
    for turns in sessions.values():
        assert [request["turn"] for request in turns] == list(range(len(turns)))
        assert len({request["split"] for request in turns}) == 1


def _entities(kind: str, entity) -> dict[str, set[str]]:
    """split -> the `entity(prompt)` of its requests."""
    found: dict[str, set[str]] = {"warmup": set(), "heldout": set()}
    for request in generate(kind):
        found[request["split"]].add(entity(request["prompt"]))
    return found


@pytest.mark.parametrize(("kind", "entity"), [
    ("agentic", lambda prompt: prompt.split("Session\n")[1].split("\n")[0]),  # the question or task
    ("self_refine", lambda prompt: prompt.split("Draft:\n\n")[1].split("\nRevision")[0]),  # the document
    ("code_edits", lambda prompt: prompt.split("\n")[0]),  # the file's name
    ("extraction", lambda prompt: prompt.rsplit("Text: ", 1)[1].split("\n")[0]),  # the passage
    ("chat", lambda prompt: prompt),
])  # fmt: skip
def test_heldout_sessions_are_about_entities_the_warmup_never_saw(kind, entity):
    found = _entities(kind, entity)
    assert found["heldout"] and found["warmup"] and not found["heldout"] & found["warmup"]


def test_prompts_end_where_the_model_writes_the_intended_shape():
    assert all(r["prompt"].endswith("Thought:") for r in generate("agentic"))
    for request in generate("self_refine"):  # the revised copy is begun right after its instruction
        tail = request["prompt"].rsplit("\nRevision ", 1)[1]
        assert re.match(r"\d \((fix|change) only [^)]*\):\n\n\S", tail) and len(tail) < 120
    assert all("```python\n" in r["prompt"].rsplit("The same file after", 1)[1] for r in generate("code_edits"))
    assert all(r["prompt"].rsplit("\n", 1)[1].startswith('{"') for r in generate("extraction"))


def test_generation_is_deterministic_and_seeded():
    for kind in PEER_KINDS:
        assert generate(kind) == generate(kind)
        assert generate(kind, seed=7) != generate(kind)
    shorter = generate("agentic", num_warmup=4, num_heldout=2)
    assert [r["split"] for r in shorter] == ["warmup"] * 4 + ["heldout"] * 2
    with pytest.raises(ValueError, match="kind must be one of"):
        generate("nope")
    with pytest.raises(ValueError, match="sessions"):
        generate("code_edits", num_warmup=30)


def test_write_all_then_load_round_trips(tmp_path):
    paths = write_all(tmp_path)
    assert [path.name for path in paths] == [f"{kind}.jsonl" for kind in PEER_KINDS]
    assert load("chat", tmp_path) == generate("chat")


def test_recorded_files_ship_with_the_package():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "data/spec_peer/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["segserve.bench"]
    assert sorted(path.name for path in DATA_DIR.glob("*.jsonl")) == sorted(f"{kind}.jsonl" for kind in PEER_KINDS)


def test_load_names_the_file_when_missing_or_bad(tmp_path):
    with pytest.raises(ValueError, match=r"chat\.jsonl: no such workload file"):
        load("chat", tmp_path)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(generate("chat")[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: not JSON"):
        load("chat", tmp_path)
    path.write_text(json.dumps({"kind": "chat", "prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: a request needs exactly the keys"):
        load("chat", tmp_path)
