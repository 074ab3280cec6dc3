"""`segserve bench spec-replay`: a mixed run's traffic replayed through drafters in-process, without a model.

In: a `segserve bench spec --mixed-concurrency N` result (its round record keeps every request's output, warm-ups
too, and the top-level record the prompts and tenants). Out: per drafter backend, node budget and price of a draft
token, what decoding that traffic would have cost: sequence-steps, draft tokens, generated tokens per step and per
token the target computes (a step's own plus its drafts: where a batch's step time grows with its tokens, as on a
CPU at 8 streams, this is what speed follows), acceptance per segment kind and workload, and the drafter's CPU
time per query (JSON, printed and written).

How: the requests run `concurrency` at a time in the order the benchmark sent them (warm-ups first, which teach
the corpora; the held-out ones are measured). Each scheduler step asks the drafter, in one batch as the scheduler
does, for a tree of `budget` nodes per running request; the step then advances each request by the longest path
of its tree that matches the recorded output, plus the token the target adds. Greedy speculation is lossless,
so the recorded output is what a greedy target writes whatever was drafted; sampled workloads' outputs stand in
for whatever the target would have sampled.

Why: one bench run of the whole stack takes twenty minutes on two cores and its tok/s moves with the machine;
the drafter's side of the comparison (which trees, how long they take to build) is deterministic and replays in
a minute, so proposers and tree shapes can be compared on the same traffic, side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from protos.segserve.v1.tree import ROOT, CandidateTree

BACKENDS = ("segserve", "suffix")


@dataclasses.dataclass
class _Request:
    """One replayed request: its tokens, how far decoding got, and what the drafter has been sent."""

    request_id: str
    kind: str
    tenant: str
    prompt: list[int]
    output: list[int]
    is_measured: bool
    num_done: int = 0
    """Output tokens generated so far."""
    num_sent: int = 0
    """Tokens (prompt + output) the drafter has."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output[: self.num_done]


@dataclasses.dataclass
class _Tally:
    num_steps: int = 0
    num_tokens: int = 0
    num_verified: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0

    def add(self, num_nodes: int, num_accepted: int, num_tokens: int) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.num_verified += num_nodes > 0
        self.num_draft_tokens += num_nodes
        self.num_accepted += num_accepted

    def summary(self) -> dict:
        num_computed = self.num_steps + self.num_draft_tokens  # each step's own token and its drafts
        return {**dataclasses.asdict(self),
                "tokens_per_step": self.num_tokens / self.num_steps if self.num_steps else None,
                "tokens_per_computed": self.num_tokens / num_computed if num_computed else None,
                "acceptance": self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else None}


def accepted_length(tree: CandidateTree, upcoming: list[int]) -> int:
    """Drafts a greedy verifier accepts: the longest root path of `tree` whose tokens are `upcoming`'s first ones."""
    children: dict[int, dict[int, int]] = defaultdict(dict)
    for node, (token_id, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        children[parent].setdefault(token_id, node)
    node, length = ROOT, 0
    for token_id in upcoming:
        node = children[node].get(token_id, -2)
        if node == -2:
            break
        length += 1
    return length


def load_requests(result_dir: Path, system: str, tokenizer) -> list[_Request]:
    """The mixed run's requests in the order they were sent (warm-ups, then held-out ones), tokenized."""
    top = json.loads((result_dir / "spec.json").read_text())
    workloads = {w["kind"]: w for w in top["workloads"]}
    runs = _round_record(result_dir)["systems"]
    if system not in runs:
        raise KeyError(f"{system!r} is not in the run (it has {sorted(runs)})")
    record = runs[system]["workloads"]["mixed"][0]
    if "warmup" not in record:
        raise ValueError("the record keeps no warm-up outputs: run `segserve bench spec` again")
    sent = [(r, False) for r in record["warmup"]] + [(r, True) for r in record["requests"]]
    requests = []
    for number, (r, is_measured) in enumerate(sent):
        workload = workloads[r["kind"]]
        prompt = tokenizer.encode(workload["prompts"][r["index"]], add_special_tokens=False)
        output = tokenizer.encode(r["text"], add_special_tokens=False)
        requests.append(_Request(f"r{number}", r["kind"], workload.get("tenant") or r["kind"], prompt, output,
                                 is_measured))
    return requests


def _round_record(result_dir: Path) -> dict:
    """The first round's record of a bench spec output folder."""
    rounds = sorted(result_dir.glob("round-*/*/spec.json"))
    if not rounds:
        raise FileNotFoundError(f"no round record under {result_dir}")
    return json.loads(rounds[0].read_text())


def replay(servicer, requests: list[_Request], budget: int, concurrency: int, node_price: float = 0.0) -> dict:
    """Every request through `servicer` (a fresh DrafterServicer), `concurrency` at a time, each asked for trees
    of `budget` nodes at `node_price` (DraftQuery.min_node_prob): the measured requests' tallies per segment kind
    and in all, and the drafter's CPU time per tree asked for."""
    queue = [dataclasses.replace(r) for r in requests]
    queue.reverse()
    running: list[_Request] = []
    finals = []  # the final updates of the requests that ended, sent with the next step's queries
    total, by_segment, by_kind = _Tally(), defaultdict(_Tally), defaultdict(_Tally)
    cpu_s, num_queries = 0.0, 0
    while queue or running or finals:
        while queue and len(running) < concurrency:
            running.append(queue.pop())
        queries = [*finals, *(_query(r, budget, node_price) for r in running)]
        finals = []
        started = time.process_time()
        replies = servicer.draft_batch(queries, [])
        servicer.planner.wait_learned()  # what a request closed is learned before the next step, as in a quiet drafter
        cpu_s += time.process_time() - started
        num_queries += len(running)
        for request, reply in zip(running, replies[len(queries) - len(running):]):
            request.num_sent = len(request.tokens)
            tree = CandidateTree.from_pb(reply.tree)
            upcoming = request.output[request.num_done:]
            accepted = accepted_length(tree, upcoming[:-1])  # the target's own token ends the step
            num_tokens = min(accepted + 1, len(upcoming))
            request.num_done += num_tokens
            if request.is_measured:
                for tally in (total, by_segment[reply.segment or "default"], by_kind[request.kind]):
                    tally.add(len(tree), accepted, num_tokens)
        for request in [r for r in running if r.num_done == len(r.output)]:
            running.remove(request)
            finals.append(dataclasses.replace(_query(request, 0), is_final=True))
            request.num_sent = len(request.tokens)
    return {"total": total.summary(), "segments": {k: t.summary() for k, t in sorted(by_segment.items())},
            "kinds": {k: t.summary() for k, t in sorted(by_kind.items())},
            "cpu_ms_per_query": 1000 * cpu_s / num_queries if num_queries else None}


def _query(request: _Request, budget: int, node_price: float = 0.0):
    from protos.segserve.v1.draft import DraftQuery

    tokens = request.tokens
    return DraftQuery(request.request_id, tokens[request.num_sent :], len(tokens), len(request.prompt), budget,
                 tenant=request.tenant, min_node_prob=node_price)


def new_servicer(backend: str, tokenizer_dir: str, tokenizer):
    """A fresh drafter (empty corpora) of `backend`, as `segserve serve` builds it for the model; "segserve:F"
    is the segserve backend with the segments file F instead of the model's own, "suffix:P" SuffixDecoding with
    min_token_prob P instead of vLLM's. A segments file that gives a kind a draft model loads it (on the CPU)."""
    from drafter.config import DrafterConfig
    from drafter.segments import load_segments
    from drafter.server import build_servicer, load_draft_models

    backend, _, option = backend.partition(":")
    config = DrafterConfig(port=0, backend=backend, tokenizer=tokenizer_dir)
    if option:
        config = dataclasses.replace(config, **({"suffix_min_token_prob": float(option)} if backend == "suffix"
                                                else {"segments_config": option}))
    segments = load_segments(config.segments_config, tokenizer)
    draft_models = load_draft_models(segments, tokenizer_dir) if backend == "segserve" else None
    return build_servicer(config, segments, draft_models)


def run_replay(args: argparse.Namespace) -> int:
    from drafter.server import load_tokenizer

    model_dir = args.model or _round_record(Path(args.result))["model"]
    tokenizer = load_tokenizer(model_dir)
    requests = load_requests(Path(args.result), args.system, tokenizer)
    if args.kinds:
        requests = [r for r in requests if r.kind in args.kinds]
    results = {"benchmark": "spec-replay", "command": " ".join(sys.argv), "result": args.result,
               "system": args.system, "concurrency": args.concurrency, "kinds": args.kinds, "runs": []}
    for budget, price, backend in itertools.product(args.budgets, args.node_prices, args.backends):
        if price and backend.startswith("suffix"):
            continue  # SuffixDecoding prunes by its own min_token_prob only
        run = replay(new_servicer(backend, model_dir, tokenizer), requests, budget, args.concurrency, price)
        results["runs"].append({"backend": backend, "budget": budget, "node_price": price, **run})
        t = run["total"]
        print(f"[spec-replay] {backend:12s} budget {budget:3d} price {price:.2f}: {t['tokens_per_step']:.2f} "
              f"tokens/step, {t['tokens_per_computed']:.3f} per token computed, acceptance {t['acceptance'] or 0:.2f}, "
              f"{run['cpu_ms_per_query']:.2f} ms CPU/query", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec-replay.json").write_text(json.dumps(results, indent=1))
    return 0


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", help="a `segserve bench spec --mixed-concurrency N` output folder")
    parser.add_argument("--system", default="segserve_off", help="whose recorded outputs to replay")
    parser.add_argument("--model", default=None, help="the model whose tokenizer and segments to use (default: the "
                        "run's)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS),
                        help="drafters to compare: segserve, suffix, or segserve:SEGMENTS.toml")
    parser.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")], default=[8, 16])
    parser.add_argument("--node-prices", type=lambda s: [float(p) for p in s.split(",")], default=[0.0],
                        help="the scheduler's price of a draft token (DraftQuery.min_node_prob) to replay at")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=None,
                        help="replay only these workloads' requests (default: all)")
    parser.add_argument("--out", default="bench-results/spec-replay")
