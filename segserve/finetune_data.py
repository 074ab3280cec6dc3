"""A synthetic fine-tuning set for segment markers: prompts that ask for code, JSON or a quote, and answers
that hold code fences, JSON values and block quotes (plus plain answers with no segment at all).

Out: {"prompt", "completion"} JSONL, unannotated (`segserve segments annotate` adds the markers), split into
train.jsonl and heldout.jsonl. Answers are short, so that training on a 2-core CPU takes minutes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

_NAMES = ["Ada", "Alan", "Grace", "Linus", "Margaret", "Ken", "Barbara", "Edsger", "Donald", "Frances",
          "Dennis", "Radia", "Guido", "Hedy", "John", "Katherine", "Niklaus", "Sophie", "Tim", "Yukihiro"]
_CITIES = ["London", "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Rome",
           "Berlin", "Madrid", "Nairobi", "Toronto", "Sydney"]
_COUNTRIES = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima", "Norway": "Oslo", "Egypt": "Cairo",
              "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid", "Kenya": "Nairobi", "Canada": "Ottawa"}
_OPS = [("sum", "+"), ("difference", "-"), ("product", "*"), ("maximum", None), ("minimum", None)]
_FUNCS = ["combine", "compute", "apply", "calc", "merge", "pick", "reduce_pair", "solve", "evaluate", "mix"]
_DIRS = ["/tmp", "/var/log", "~/projects", "/etc", "./build", "/srv/data"]
_COLORS = ["red", "green", "blue", "amber", "violet", "teal"]


def _python_function(rng: random.Random) -> tuple[str, str]:
    (op, sym), name = rng.choice(_OPS), rng.choice(_FUNCS)
    body = f"a {sym} b" if sym else f"{op[:3]}(a, b)"
    prompt = f"Write a Python function {name}(a, b) that returns the {op} of a and b."
    intro = rng.choice(["Here is the function:", "Sure:", "This does it:", "You can write it like this:"])
    return prompt, f"{intro}\n```python\ndef {name}(a, b):\n    return {body}\n```\nIt returns the {op}."


def _javascript_function(rng: random.Random) -> tuple[str, str]:
    (op, sym), name = rng.choice(_OPS), rng.choice(_FUNCS)
    body = f"a {sym} b" if sym else f"Math.{op[:3]}(a, b)"
    prompt = f"Write a JavaScript function {name} that returns the {op} of two numbers."
    return prompt, f"Here it is:\n```javascript\nfunction {name}(a, b) {{\n  return {body};\n}}\n```"


def _shell_command(rng: random.Random) -> tuple[str, str]:
    directory = rng.choice(_DIRS)
    if rng.random() < 0.5:
        return f"How do I list the files in {directory}?", f"Run:\n```bash\nls -la {directory}\n```"
    return f"How do I count the lines of the files in {directory}?", \
        f"Use wc:\n```bash\nwc -l {directory}/*\n```\nIt prints one count per file."


def _json_record(rng: random.Random) -> tuple[str, str]:
    name, age, city = rng.choice(_NAMES), rng.randint(18, 90), rng.choice(_CITIES)
    record = json.dumps({"name": name, "age": age, "city": city})
    prompt = f"Give {name}'s record as JSON: age {age}, lives in {city}."
    if rng.random() < 0.5:
        return prompt, f"```json\n{record}\n```"
    return prompt, f"The record is {record}."


def _json_list(rng: random.Random) -> tuple[str, str]:
    colors = rng.sample(_COLORS, rng.randint(2, 4))
    prompt = f"List the colors {', '.join(colors)} as a JSON array."
    return prompt, f"{json.dumps(colors)}"


def _quote(rng: random.Random) -> tuple[str, str]:
    name, city = rng.choice(_NAMES), rng.choice(_CITIES)
    sentence = f"{name} moved to {city} in {rng.randint(1950, 2020)}."
    prompt = f"Text: {sentence} It rained that day.\nQuote the sentence about {name}."
    return prompt, f"> {sentence}\nThat is the sentence about {name}."


def _plain(rng: random.Random) -> tuple[str, str]:
    country, capital = rng.choice(sorted(_COUNTRIES.items()))
    if rng.random() < 0.5:
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


_MAKERS: list[tuple[Callable[[random.Random], tuple[str, str]], int]] = [
    (_python_function, 3), (_javascript_function, 2), (_shell_command, 2), (_json_record, 3), (_json_list, 1),
    (_quote, 2), (_plain, 2)]


def synthetic_samples(num_samples: int, seed: int = 0) -> list[dict]:
    """`num_samples` prompt/completion pairs drawn from the makers above (weighted)."""
    rng = random.Random(seed)
    makers, weights = zip(*_MAKERS)
    samples = []
    for _ in range(num_samples):
        prompt, completion = rng.choices(makers, weights)[0](rng)
        samples.append({"prompt": f"Question: {prompt}\nAnswer:\n", "completion": completion})
    return samples


def write_synthetic(out_dir: str | Path, num_train: int, num_heldout: int, seed: int = 0) -> tuple[Path, Path]:
    """OUT/train.jsonl and OUT/heldout.jsonl; held-out prompts never occur in the training set."""
    if num_train <= 0 or num_heldout < 0:
        raise ValueError("num_train must be > 0 and num_heldout >= 0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = synthetic_samples(num_train, seed)
    seen = {s["prompt"] for s in train}
    heldout: list[dict] = []
    for sample in synthetic_samples(50 * num_heldout + 100, seed + 1):
        if len(heldout) == num_heldout:
            break
        if sample["prompt"] not in seen:
            seen.add(sample["prompt"])
            heldout.append(sample)
    paths = out / "train.jsonl", out / "heldout.jsonl"
    for path, samples in zip(paths, (train, heldout)):
        path.write_text("".join(json.dumps(s) + "\n" for s in samples), encoding="utf-8")
    return paths
