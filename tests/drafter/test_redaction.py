"""What a drafter learns passes through reflow's redaction when --redact-corpora is on: the corpus, the shared
log and the snapshot never hold the e-mail address a request wrote, and a segment with nothing to redact is
learned as it came."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from drafter.config import DrafterConfig
from drafter.memory import SharedMemory, load_corpora
from drafter.planner import DraftPlanner
from drafter.redaction import SegmentRedactor
from drafter.segment_log import DirectorySegmentLog
from drafter.segments import parse_segments
from drafter.server import build_servicer
from segserve.cli import build_parser

RAW = {"segment": [{"name": "code", "start": 1, "end": 1, "max_depth": 16}]}
SECRET = "mail alice.smith@example.com for the key"


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(tiny_gemma3_dir)


def test_the_redactor_rewrites_only_text_with_something_to_redact(tokenizer):
    redact = SegmentRedactor(tokenizer)
    secret_ids = tokenizer.encode(SECRET, add_special_tokens=False)
    assert tokenizer.decode(redact(secret_ids)) == "mail [EMAIL] for the key"
    clean_ids = tokenizer.encode("def add(a, b): return a + b", add_special_tokens=False)
    assert list(redact(clean_ids)) == clean_ids


@pytest.mark.parametrize("is_redacting", [True, False])
def test_corpus_log_and_snapshot_hold_the_redacted_segment(tokenizer, tmp_path, is_redacting):
    segments = parse_segments(RAW)
    snapshot_dir = tmp_path / "snap"
    memory = SharedMemory(DraftPlanner(segments), DirectorySegmentLog(tmp_path / "log", "a"), snapshot_dir, "a",
                          "directory", redact=SegmentRedactor(tokenizer) if is_redacting else None)
    secret_ids = tokenizer.encode(SECRET, add_special_tokens=False)
    memory.learn("code", secret_ids)
    memory.snapshot()

    logged = DirectorySegmentLog(tmp_path / "log", "reader").read(None, 10)[0]
    assert [tokenizer.decode(record.token_ids) for record in logged] == (
        ["mail [EMAIL] for the key"] if is_redacting else [SECRET])
    restored = load_corpora(segments, snapshot_dir)["code"]
    context = tokenizer.encode("mail", add_special_tokens=False)
    found = restored.propose(context[-2:] if len(context) > 1 else [*secret_ids[:1]], 16, 1)
    proposed = tokenizer.decode(list(found[0].token_ids)) if found else ""
    assert ("alice" in proposed) != is_redacting, proposed


def test_the_flag_turns_the_drafters_redaction_on(tiny_gemma3_dir):
    args = build_parser().parse_args(["drafter", "--redact-corpora", "--tokenizer", str(tiny_gemma3_dir)])
    config = DrafterConfig(redact_corpora=args.redact_corpora, tokenizer=args.tokenizer)
    assert isinstance(build_servicer(config, parse_segments(RAW)).memory.redact, SegmentRedactor)
    assert build_servicer(DrafterConfig(), parse_segments(RAW)).memory.redact is None
