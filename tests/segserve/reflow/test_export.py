"""Exports: OpenAI fine-tuning chat JSONL and Parquet, through the CLI."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from router.reflow.config import RecorderConfig
from router.reflow.queue import open_queue
from router.reflow.recorder import Recorder
from segserve.cli import main
from segserve.reflow.config import ConsumerConfig
from segserve.reflow.consumer import consume
from segserve.reflow.export import chat_examples
from tests.support.reflow_helpers import record_chats


def _logs(tmp_path, sink_format="jsonl"):
    url = f"sqlite:///{tmp_path}/queue.db"
    recorder = Recorder(open_queue(url), RecorderConfig(spill_dir=str(tmp_path / "spill"))).start()
    expected = record_chats(recorder, num_sessions=3, num_turns=2)
    recorder.close()
    consume(ConsumerConfig(queue_url=url, sink_dir=str(tmp_path / "logs"), sink_format=sink_format, is_drain=True))
    return expected


def test_openai_chat_export_is_valid_fine_tuning_jsonl(tmp_path):
    _logs(tmp_path)
    out = tmp_path / "train.jsonl"
    assert main(["reflow", "export", "--logs", str(tmp_path / "logs"), "--format", "openai-chat",
                 "--out", str(out)]) == 0
    examples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(examples) == 3  # one per conversation: its last turn holds the whole history
    for example in examples:
        assert set(example) == {"messages"}
        roles = [m["role"] for m in example["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in example["messages"])


def test_parquet_sink_and_export_read_back(tmp_path):
    expected = _logs(tmp_path, sink_format="parquet")
    out = tmp_path / "turns.parquet"
    assert main(["reflow", "export", "--logs", str(tmp_path / "logs"), "--format", "parquet", "--out", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["request_id"] for r in rows) == sorted(i for ids in expected.values() for i in ids)
    assert all(json.loads(r["request"])["messages"] and r["finish"] == "complete" for r in rows)


def test_unfinished_and_tool_turns_are_not_training_examples():
    base = {"finish": "complete", "response_text": "ok"}
    turns = [{**base, "finish": "cancelled", "request": {"messages": [{"role": "user", "content": "a"}]}},
             {**base, "request": {"messages": [{"role": "tool", "content": "b"}]}},
             {**base, "request": {"prompt": "c"}}]
    assert list(chat_examples(turns)) == [[{"role": "user", "content": "c"}, {"role": "assistant", "content": "ok"}]]


def test_each_of_a_completions_prompts_is_its_own_example():
    turn = {"finish": "complete", "response_text": "a0", "request": {"prompt": ["p", "q", "r"], "n": 2},
            "other_choices": [{"index": 1, "text": "a1"}, {"index": 2, "text": "b0"}, {"index": 3, "text": "b1"}]}
    assert list(chat_examples([turn])) == [
        [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a0"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b0"}],
    ]  # prompt r's choices (4 and 5) were not recorded: no example
    ids = {**turn, "request": {"prompt": [[1, 2], [3]], "n": 2}}
    assert list(chat_examples([ids])) == []


def test_corpus_build_from_reflow_learns_what_the_model_wrote(tiny_gemma3_dir, tmp_path):
    """A recorded completion whose reply holds a code block feeds the drafter's code corpus."""
    from transformers import AutoTokenizer

    from drafter.corpus import LookupCorpus
    from drafter.memory import corpus_path
    from router.reflow.chunks import FinishState
    from tests.segserve.test_cli import _TINY_SEGMENTS

    url = f"sqlite:///{tmp_path}/queue.db"
    recorder = Recorder(open_queue(url), RecorderConfig(spill_dir=str(tmp_path / "spill"))).start()
    reply = "Sure:\n```\nfor i in range(10):\n    print(i)\n```\nDone."
    body = json.dumps({"model": "m", "prompt": "Print the digits."}).encode()
    recording = recorder.start_request("cmpl-1", "client-a", "m", body)
    for index, piece in enumerate(reply.split(" ")):
        recording.delta(piece if index == 0 else " " + piece, [index])
    recording.finish(FinishState.COMPLETE)
    unfinished = recorder.start_request("cmpl-2", "client-a", "m", json.dumps({"prompt": "x"}).encode())
    unfinished.delta("```\nnever learned\n```", [0])
    unfinished.finish(FinishState.CANCELLED)
    recorder.close()
    consume(ConsumerConfig(queue_url=url, sink_dir=str(tmp_path / "logs"), is_drain=True))

    segments = tmp_path / "segments.toml"
    segments.write_text(_TINY_SEGMENTS)
    out = tmp_path / "corpora"
    assert main(["corpus", "build", "--from-reflow", str(tmp_path / "logs"), "--out", str(out),
                 "--tokenizer", str(tiny_gemma3_dir), "--segments-config", str(segments)]) == 0
    code = LookupCorpus.load(corpus_path(out, "code"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    fenced = tokenizer.encode("```\nfor i in range(10):\n    print(i)\n```", add_special_tokens=False)
    best = code.propose(fenced[:5], max_len=4, max_candidates=4)[0]
    assert list(best.token_ids) == fenced[5:9]
    never = tokenizer.encode("```\nnever learned", add_special_tokens=False)
    assert all(list(c.token_ids[:1]) != never[3:4] for c in code.propose(never[:3], max_len=2, max_candidates=8))
