"""lm-evaluation-harness as a client: the same local tasks scored through segserve and by transformers agree.

A tiny random Gemma3 whose tokenizer adds <bos> (as gemma's does) is served by a
real stack. Two local tasks (JSONL written here, no hub): a multiple-choice one
(log-likelihoods of four choices per item) and a greedy generation one of at most
12 tokens that stops at a newline or "``" (which most of its texts reach).
lm-eval scores them with `local-completions` three ways (its remote tokenizer on
/tokenizer_info, /tokenize and /detokenize; the HF tokenizer; and text prompts the
router tokenizes itself) and with `hf` on the same checkpoint (cpu, float32).
Every choice's log-likelihood must agree within 1e-3 and every generation must be
identical. The prompts begin with the "<bos>" text, as lm-eval's remote tokenizer
(which never adds special tokens) needs for a BOS model: `hf` then adds no BOS of
its own, and neither may the router to a text prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.e2e_helpers import served_model_name, start_stack
from tests.support.tiny_models import build_tiny_gemma3

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Tokyo", "London"], 0),
    ("What does the fox jump over?", ["the lazy dog", "a fence", "the moon", "a river"], 0),
    ("Which keyword defines a function in Python?", ["def", "fn", "func", "lambda"], 0),
    ("What is 3 squared?", ["9", "6", "3", "33"], 0),
    ("Which city is in Japan?", ["Tokyo", "Paris", "Ada", "Rome"], 0),
    ("What does print(i * i) print for i = 2?", ["4", "2", "22", "8"], 0),
]
PROMPTS = ["The quick brown fox", "def add(a, b):", "User: what is the capital of France?", "for i in range(10):",
           "Übermäßig schöne", "The capital of France is"]
MC_TASK = """task: segserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "<bos>Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: segserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "<bos>{{{{prompt}}}}"
doc_to_target: ""
generation_kwargs:
  until: ["\\n", "``"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: bleu
"""


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-bos"), is_bos_added=True)


@pytest.fixture(scope="module")
def stack(bos_model_dir, tmp_path_factory):
    stack = start_stack(bos_model_dir, tmp_path_factory.mktemp("logs"), num_kv_blocks=128, block_size=16)
    try:
        yield stack
    finally:
        stack.stop()


def write_tasks(folder: Path) -> None:
    """The two tasks' YAMLs and JSONL documents in `folder`."""
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (folder / "segserve_mc.yaml").write_text(MC_TASK.format(data=mc))
    (folder / "segserve_gen.yaml").write_text(GEN_TASK.format(data=gen))


def run_lm_eval(tmp_path: Path, runs: dict) -> dict:
    """`runs` ({name: {model, model_args}}) through lm-eval in a process of its own, offline; its responses."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"include_path": str(tasks), "tasks": ["segserve_mc", "segserve_gen"], "runs": runs}))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "unused"}
    done = subprocess.run([sys.executable, "-m", "tests.support.lm_eval_runner", str(spec), str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_lm_eval_through_segserve_matches_transformers(stack, bos_model_dir, tmp_path):
    base = stack.base_url + "/v1/completions"
    served = {"model": served_model_name(stack), "base_url": base, "max_retries": 1, "timeout": 120}
    runs = {
        "remote": {"model": "local-completions", "model_args": {**served, "tokenizer_backend": "remote"}},
        "hf_tokenizer": {"model": "local-completions",
                         "model_args": {**served, "tokenizer_backend": "huggingface", "tokenizer": str(bos_model_dir)}},
        "text_prompts": {"model": "local-completions",
                         "model_args": {**served, "tokenizer_backend": "remote", "tokenized_requests": False}},
        "hf": {"model": "hf", "model_args": {"pretrained": str(bos_model_dir), "dtype": "float32", "device": "cpu"}},
    }
    out = run_lm_eval(tmp_path, runs)
    reference = out.pop("hf")
    choices = [ll for item in reference["segserve_mc"] for ll in item]
    assert len(choices) == sum(len(c) for _, c, _ in QUESTIONS)
    texts = [item[0] for item in reference["segserve_gen"]]
    assert len(texts) == len(PROMPTS) and any(texts), "the reference generated nothing to compare"
    for name, got in out.items():
        lls = [ll for item in got["segserve_mc"] for ll in item]
        worst = max(abs(a - b) for a, b in zip(lls, choices, strict=True))
        assert worst < 1e-3, f"{name}: log-likelihoods differ by up to {worst:.2e}: {lls} vs {choices}"
        assert [item[0] for item in got["segserve_gen"]] == texts, name
