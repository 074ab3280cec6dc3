"""lm-evaluation-harness run as its users run it, in a process of its own: `python -m tests.support.lm_eval_runner
SPEC OUT`.

SPEC (JSON): {"include_path": the folder of the task YAMLs, "tasks": [names], "runs": {name: {"model": an
lm-eval model type, "model_args": {...}}}}. Each run is one `lm_eval.simple_evaluate` with every sample logged;
OUT (JSON) gets, per run and task, each document's responses in doc_id order: a multiple-choice task's
log-likelihood per choice, a generation task's text. The caller sets the environment (offline, caches).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(spec: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=spec["include_path"], include_defaults=False)
    out = {}
    for name, run_spec in spec["runs"].items():
        results = simple_evaluate(model=run_spec["model"], model_args=run_spec["model_args"], tasks=spec["tasks"],
                                  task_manager=tasks, batch_size=1, log_samples=True, bootstrap_iters=0)
        out[name] = {task: [_responses(sample) for sample in sorted(samples, key=lambda s: s["doc_id"])]
                     for task, samples in results["samples"].items()}
    return out


def _responses(sample: dict) -> list:
    """One document's raw responses: per request, its log-likelihood (a float) or its generated text."""
    return [response[0] if isinstance(response[0], str) else response[0][0] for response in sample["resps"]]


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:]
    Path(out_path).write_text(json.dumps(run(json.loads(Path(spec_path).read_text()))))
