"""Fine-tuning to emit segment markers: training on annotated samples, the checkpoint the worker serves,
marker-placement scoring, the router hiding the markers, and the CLI."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.ports import free_port
from router.config import RouterConfig
from router.detokenizer import SEGMENT_MARKERS_KEY, IncrementalDetokenizer, segment_marker_ids
from segserve.annotate import MARKERS_KEY, annotate, annotate_sample, insert_markers, load_marked_kinds
from segserve.cli import build_parser, main
from segserve.finetune import FinetuneConfig, _batch_loss, encode_sample, finetune, load_model_for_tokenizer
from segserve.finetune_data import synthetic_samples, write_synthetic
from segserve.finetune_eval import evaluate, marker_positions, score, true_positions
from tests.support.fake_scheduler import start_fake_scheduler
from tests.support.router_server import serve_router
from tests.worker.test_model_runner import Decoder, make_runner, reference_greedy, run_together

KINDS = load_marked_kinds()
MARKED_TEXT = 'Sure:\n```python\nx = 1\n```\nThe record is {"a": [1, 2]}.'


@pytest.fixture(scope="module")
def annotated(tmp_path_factory, tiny_gemma3_dir):
    """A small synthetic set, annotated with the tiny model's tokenizer."""
    root = tmp_path_factory.mktemp("finetune")
    train, heldout = write_synthetic(root / "data", num_train=24, num_heldout=2, seed=3)
    annotate([train], root / "annotated", tiny_gemma3_dir)
    return root, heldout


@pytest.fixture(scope="module")
def tokenizer(annotated):
    return AutoTokenizer.from_pretrained(str(annotated[0] / "annotated" / "tokenizer"))


def _mean_label_loss(model, tokenizer, path) -> float:
    samples = [encode_sample(json.loads(line), tokenizer, 256) for line in path.read_text().splitlines()]
    with torch.no_grad():
        return _batch_loss(model.eval(), samples, tokenizer.pad_token_id).item()


def test_synthetic_set_is_deterministic_and_holds_out_unseen_prompts(tmp_path):
    assert synthetic_samples(20, seed=1) == synthetic_samples(20, seed=1)
    train, heldout = write_synthetic(tmp_path, num_train=50, num_heldout=10)
    train_prompts = {json.loads(line)["prompt"] for line in train.read_text().splitlines()}
    held = [json.loads(line) for line in heldout.read_text().splitlines()]
    assert len(held) == 10 and not train_prompts & {s["prompt"] for s in held}
    with pytest.raises(ValueError, match="num_train"):
        write_synthetic(tmp_path, num_train=0, num_heldout=1)


def test_label_tokens_are_the_completion_and_eos(tokenizer):
    ids, num_prompt = encode_sample({"prompt": "Q:", "completion": "<seg:code>x</seg:code>"}, tokenizer, 64)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[num_prompt:-1]) == "<seg:code>x</seg:code>"
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "<seg:json>[1]</seg:json>"}]}
    ids, num_prompt = encode_sample(chat, tokenizer, 64)
    assert tokenizer.decode(ids[num_prompt:]).startswith("<seg:json>[1]</seg:json>")
    with pytest.raises(ValueError, match="no label tokens"):
        encode_sample({"prompt": "a long prompt " * 20, "completion": "x"}, tokenizer, 8)


def test_lora_finetune_lowers_the_loss_and_the_worker_serves_the_checkpoint(annotated, tokenizer, tiny_gemma3_dir):
    root, _ = annotated
    out = root / "lora"
    summary = finetune(root / "annotated", tiny_gemma3_dir, out,
                       FinetuneConfig(num_epochs=4, batch_size=8, learning_rate=1e-2))
    assert summary["num_steps"] == 12 and summary["last_loss"] < summary["first_loss"]
    assert summary["num_trainable_params"] < 100_000  # adapters and marker rows, not the whole model

    # The merged checkpoint, reloaded from disk, fits the samples better than the base it started from.
    samples = root / "annotated" / "samples.jsonl"
    torch.manual_seed(0)
    base_loss = _mean_label_loss(load_model_for_tokenizer(tiny_gemma3_dir, tokenizer), tokenizer, samples)
    tuned = AutoModelForCausalLM.from_pretrained(str(out))
    assert _mean_label_loss(tuned, tokenizer, samples) < base_loss - 0.5
    saved = AutoTokenizer.from_pretrained(str(out))
    assert len(saved) == tuned.config.vocab_size == len(tokenizer)
    assert saved.init_kwargs[MARKERS_KEY] == tokenizer.init_kwargs[MARKERS_KEY]

    # The worker loads it (vocabulary with the markers) and decodes as transformers does.
    runner = make_runner(out)
    assert runner.info().vocab_size == len(tokenizer)
    prompt = tokenizer.encode("Question: code\nAnswer:\n<seg:code>", add_special_tokens=True)
    got = run_together(runner, [Decoder("m", prompt, list(range(12)))], 6)["m"]
    assert got == reference_greedy(runner.model, prompt, 6)


def test_full_finetune_of_an_untied_model(tmp_path, tiny_llama_dir):
    train, _ = write_synthetic(tmp_path / "data", num_train=8, num_heldout=0)
    annotate([train], tmp_path / "annotated", tiny_llama_dir)
    summary = finetune(tmp_path / "annotated", tiny_llama_dir, tmp_path / "full",
                       FinetuneConfig(max_steps=4, batch_size=4, learning_rate=3e-3, is_full=True))
    assert summary["num_steps"] == 4 and summary["last_loss"] < summary["first_loss"]
    assert summary["num_trainable_params"] > 100_000
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "full")).config.vocab_size == 408


def test_finetune_needs_an_annotation_directory(tmp_path, tiny_gemma3_dir):
    with pytest.raises(FileNotFoundError, match="not an annotation directory"):
        finetune(tmp_path, tiny_gemma3_dir, tmp_path / "out", FinetuneConfig())
    with pytest.raises(ValueError, match="batch_size"):
        FinetuneConfig(batch_size=0)


def _marker_ids(tokenizer) -> dict[int, str]:
    return {tokenizer.convert_tokens_to_ids(m): m for k in KINDS for m in (k.start, k.end)}


def test_scoring_counts_markers_at_the_rules_boundaries(tokenizer):
    marker_of = _marker_ids(tokenizer)
    exact = tokenizer.encode(insert_markers(MARKED_TEXT, KINDS), add_special_tokens=False)
    clean, generated = marker_positions(exact, marker_of)
    assert [m for m, _ in generated] == ["<seg:code>", "</seg:code>", "<seg:json>", "</seg:json>"]
    assert sorted(true_positions(clean, tokenizer, KINDS)) == sorted(generated)
    assert score([exact], tokenizer, KINDS, marker_of, tolerance=0)["precision"] == 1.0

    # The code end marker three tokens late, and the JSON markers left out.
    late = [t for t in exact if marker_of.get(t, "").find("json") < 0]
    end = late.index(tokenizer.convert_tokens_to_ids("</seg:code>"))
    late.insert(end + 3, late.pop(end))
    result = score([late], tokenizer, KINDS, marker_of, tolerance=1)
    assert (result["num_generated_markers"], result["num_true_markers"], result["num_matched"]) == (2, 4, 1)
    assert (result["precision"], result["recall"]) == (0.5, 0.25)
    assert score([late], tokenizer, KINDS, marker_of, tolerance=3)["num_matched"] == 2

    plain = tokenizer.encode(MARKED_TEXT, add_special_tokens=False)
    assert score([plain], tokenizer, KINDS, marker_of, 1) == {
        "precision": 0.0, "recall": 0.0, "num_generated_markers": 0, "num_true_markers": 4, "num_matched": 0}


def test_evaluate_reports_both_models(annotated, tiny_gemma3_dir, tmp_path):
    root, heldout = annotated
    model_dir = root / "lora" if (root / "lora").is_dir() else None
    if model_dir is None:  # this test alone: a checkpoint of one step
        model_dir = tmp_path / "one"
        finetune(root / "annotated", tiny_gemma3_dir, model_dir, FinetuneConfig(max_steps=1))
    report = evaluate(model_dir, tiny_gemma3_dir, [heldout], tmp_path / "eval.json", extra_tokens=0)
    assert json.loads((tmp_path / "eval.json").read_text()) == report
    assert set(report["models"]) == {"finetuned", "base"} and report["num_samples"] == 2
    num_markers = sum(2 * sum(annotate_sample(json.loads(line), KINDS)[1].values())
                      for line in heldout.read_text().splitlines())
    for result in report["models"].values():
        assert 0.0 <= result["precision"] <= 1.0 and 0.0 <= result["recall"] <= 1.0
        assert result["reference"]["num_true_markers"] == num_markers > 0
        assert 0.0 <= result["reference"]["precision"] <= 1.0
    with pytest.raises(ValueError, match="lacks the markers"):
        evaluate(tiny_gemma3_dir, tiny_gemma3_dir, [heldout], tmp_path / "x.json")


def test_detokenizer_hides_markers_but_not_other_tokens(tokenizer):
    assert SEGMENT_MARKERS_KEY == MARKERS_KEY
    hidden = segment_marker_ids(tokenizer)
    assert hidden == frozenset(_marker_ids(tokenizer))
    ids = tokenizer.encode(insert_markers(MARKED_TEXT, KINDS), add_special_tokens=False)
    stripped = IncrementalDetokenizer(tokenizer, hidden_token_ids=hidden)
    assert "".join(stripped.add([t]) for t in ids) + stripped.flush() == MARKED_TEXT
    shown = IncrementalDetokenizer(tokenizer)
    assert "".join(shown.add([t]) for t in ids) + shown.flush() == insert_markers(MARKED_TEXT, KINDS)


@pytest.mark.parametrize("is_strip", [True, False])
def test_router_strips_markers_from_text_and_counts_them_as_tokens(tokenizer, is_strip):
    server, fake, port = start_fake_scheduler(tokenizer)
    fake.output_ids = tokenizer.encode(insert_markers(MARKED_TEXT, KINDS), add_special_tokens=False)
    config = RouterConfig(scheduler_address=f"127.0.0.1:{port}", port=free_port(), scheduler_wait_s=10,
                          is_grpc_api=False, is_strip_segment_markers=is_strip)
    try:
        with serve_router(config, tokenizer=tokenizer) as url:
            body = {"prompt": "Q", "max_tokens": 100}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
    finally:
        server.stop(grace=None)
    expected = MARKED_TEXT if is_strip else insert_markers(MARKED_TEXT, KINDS)
    assert reply["choices"][0]["text"] == expected
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
    assert reply["usage"]["completion_tokens"] == len(fake.output_ids) + 1  # the markers and EOS count


def test_cli_parses_the_commands():
    parser = build_parser()
    args = parser.parse_args(["segments", "annotate", "a.jsonl", "--out", "o", "--rule", "code=code_fence",
                              "--from-reflow", "logs"])
    assert (args.files, args.out, args.rule, args.from_reflow) == (["a.jsonl"], "o", ["code=code_fence"], ["logs"])
    args = parser.parse_args(["finetune", "--data", "d", "--out", "o", "--full", "--max-steps", "3"])
    assert (args.data, args.is_full, args.max_steps, args.num_epochs) == ("d", True, 3, None)
    args = parser.parse_args(["segments", "eval", "h.jsonl", "--model", "m", "--out", "r.json", "--tolerance", "2"])
    assert (args.files, args.model, args.tolerance, args.base_model) == (["h.jsonl"], "m", 2, None)
    assert parser.parse_args(["serve", "--no-strip-segment-markers"]).is_strip_segment_markers is False


@pytest.mark.parametrize("command", [["finetune"], ["segments", "annotate"], ["segments", "synth"],
                                     ["segments", "eval"]])
def test_cli_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0 and "--out" in capsys.readouterr().out


def test_cli_synth_and_bad_rule(tmp_path, capsys):
    assert main(["segments", "synth", "--out", str(tmp_path), "--num-train", "5", "--num-heldout", "2"]) == 0
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 5
    assert main(["segments", "annotate", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "a"),
                 "--rule", "code"]) == 2
    assert "--rule takes SEGMENT=RULE" in capsys.readouterr().err
