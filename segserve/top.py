"""`segserve top`: the router's GET /status as a live terminal view (rich), refreshed every --interval-s.

In: the router's base URL. Out: a screen of panels: components' health,
requests running and waiting, KV usage and the prefix cache's hit rate,
acceptance, drafting on/off and the speculation gate's state per segment kind
with the gate's latest decision, a drafters table (live or backing off, corpus size per segment
kind), the reflow backlog. A router that does not answer
shows as such and the view keeps polling; Ctrl+C ends it.
"""

from __future__ import annotations

import time

import httpx
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _health(value: str | None) -> Text:
    value = value or "unknown"
    style = "green" if value in ("ok", "ready") or value.endswith("live") and not value.startswith("0/") else "red"
    return Text(value, style=style)


def _overview(status: dict) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    components = status.get("components") or {}
    for name in ("router", "scheduler", "workers"):
        table.add_row(name, _health(components.get(name)))
    requests, kv, prefix = status.get("requests"), status.get("kv_cache"), status.get("prefix_cache")
    if requests is not None:
        table.add_row("requests", f"{requests['running']} running, {requests['waiting']} waiting, "
                                  f"{requests['preemptions']} preempted")
    if kv is not None:
        table.add_row("KV cache", f"{_percent(kv['usage'])} ({kv['used_blocks']}/{kv['total_blocks']} blocks)")
    if prefix is not None:
        table.add_row("prefix cache", f"{_percent(prefix['hit_rate'])} hit rate ({prefix['hits']}/{prefix['queries']} "
                                      "tokens)")
    reflow = status.get("reflow")
    table.add_row("reflow backlog", "off" if reflow is None else
                  f"{reflow['queue_depth']} chunks queued (oldest {reflow['oldest_chunk_age_s']:.1f} s), "
                  f"{reflow['buffered_chunks']} buffered, {reflow['spill_bytes']} B spilled")
    if status.get("detail"):
        table.add_row("detail", status["detail"])
    return table


def _drafting(seg: dict) -> Text:
    return (Text(f"on, {seg['budget_nodes']} nodes", style="green") if seg.get("is_drafting")
            else Text("off", style="yellow"))


def _sizes(bucket: int) -> str:
    """A batch-size bucket (a power of two) as the batch sizes it holds: bucket // 2 + 1 to bucket sequences."""
    return str(bucket) if bucket == 1 else f"{bucket // 2 + 1}-{bucket}"


def _gate(spec: dict | None) -> str:
    gate = (spec or {}).get("gate")
    if gate is None:
        return "gate: no decision yet"
    return f"gate: speculation {'on' if gate['is_open'] else 'off'} for batches of {_sizes(gate['batch_bucket'])} " \
           "sequences"


def _segment_gate(seg: dict) -> Text:
    """The gate's state for one segment kind, at the batch size of its latest step."""
    gate = seg.get("gate")
    if gate is None:
        return Text("-")
    sizes = _sizes(gate["batch_bucket"])
    return (Text(f"open ({sizes} seqs)", style="green") if gate["is_open"]
            else Text(f"closed ({sizes} seqs)", style="yellow"))


def _speculation(status: dict) -> Table:
    spec = status.get("speculation")
    table = Table(expand=True, caption=_gate(spec), caption_justify="left")
    for name in ("segment", "drafting", "gate", "trees", "draft tokens", "accepted", "acceptance", "per tree"):
        table.add_column(name, justify="left" if name in ("segment", "drafting", "gate") else "right",
                         no_wrap=name in ("drafting", "gate"))
    for seg in (spec or {}).get("segments", []):
        per_tree = seg["accepted_per_draft"]
        table.add_row(seg["segment"] or "(unknown)", _drafting(seg), _segment_gate(seg), str(seg["num_drafts"]),
                      str(seg["num_draft_tokens"]), str(seg["num_accepted_tokens"]), _percent(seg["acceptance"]),
                      "-" if per_tree is None else f"{per_tree:.2f}")
    if spec is not None:
        table.add_row("all", "", "", str(spec["num_drafts"]), str(spec["num_draft_tokens"]),
                      str(spec["num_accepted_tokens"]), _percent(spec["acceptance"]), "", style="bold")
    return table


def _size(num_bytes: float) -> str:
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}"


def _drafters(status: dict) -> Table:
    """One row per drafter replica and segment kind: corpus entries and memory, requests in that segment."""
    table = Table(expand=True)
    for name in ("drafter", "state", "segment", "corpus entries", "corpus memory", "requests"):
        table.add_column(name, justify="left" if name in ("drafter", "state", "segment") else "right")
    for replica in status.get("drafters") or []:
        state = Text("live" if replica["is_live"] else "backing off", style="green" if replica["is_live"] else "red")
        if not replica["is_answering"]:
            table.add_row(replica["address"], state, Text("no stats (no answer)", style="red"), "", "", "")
            continue
        for i, seg in enumerate(replica["segments"]):
            table.add_row(replica["address"] if i == 0 else "", state if i == 0 else "", seg["segment"],
                          str(seg["corpus_entries"]), _size(seg["corpus_bytes"]), str(seg["num_requests"]))
    return table


def render(status: dict | None, url: str, error: str = "") -> Group:
    """The screen for one /status answer (None: the router did not answer; `error` says why)."""
    title = f"segserve top · {url}" + (f" · {status['model']}" if status else "")
    if status is None:
        return Group(Panel(Text(f"router unreachable: {error}", style="red"), title=title))
    return Group(Panel(_overview(status), title=title),
                 Panel(_speculation(status), title="speculation per segment"),
                 Panel(_drafters(status), title="drafters"))


def fetch_status(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url.rstrip("/") + "/status", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def run(url: str, interval_s: float = 1.0, api_key: str | None = None, iterations: int | None = None) -> int:
    """Poll and redraw until Ctrl+C (or `iterations` screens, for scripts)."""
    count = 0
    with Live(render(None, url, "connecting"), auto_refresh=False, screen=False) as live:
        try:
            while iterations is None or count < iterations:
                try:
                    live.update(render(fetch_status(url, api_key), url), refresh=True)
                except (httpx.HTTPError, ValueError) as exc:
                    live.update(render(None, url, str(exc) or type(exc).__name__), refresh=True)
                count += 1
                if iterations is None or count < iterations:
                    time.sleep(interval_s)
        except KeyboardInterrupt:
            pass
    return 0
