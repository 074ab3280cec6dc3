"""The router's per-token path: chunks that piled up merge into one delta, prebuilt SSE JSON equals the
models' own, and the tokenizer's Rust decoder is used only where it decodes exactly like transformers."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from protos.segserve.v1.generate import FinishReason, GenerateComplete, GenerateRequest, TokenChunk
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from protos.segserve.v1.step_result import PromptLogprobs, TopLogprobs
from router.detokenizer import IncrementalDetokenizer, backend_decoder
from router.generation import Delta, GenerationJob, generate_deltas, merge_chunks
from router.responses import ChatDelta, ChatRenderer, ChatStreamChoice, CompletionChoice, CompletionRenderer
from router.v2 import V2Renderer
from tests.support.fake_scheduler import ScriptedClient
from tests.support.tiny_models import build_tokenizer

TEXTS = ["hi", 'quote " backslash \\ newline \n tab \t nul \x00 unit \x1f del \x7f', "é 東京 🙂 \u2028 </script>"]


def test_consecutive_chunks_merge_in_order_and_a_chunk_with_prompt_logprobs_stays_apart():
    top = TopLogprobs((5, 6), (-0.1, -2.0))
    prompt = PromptLogprobs(start=1, logprobs=(-1.0,))
    done = GenerateComplete(FinishReason.LENGTH, 3, 4)
    events = [TokenChunk((1,), (0.1,), (top,), 2, 7), TokenChunk((2, 3), (0.2, 0.3), (top, top), 4, 8),
              TokenChunk((6,), (0.6,), (top,)), TokenChunk((4,), (0.4,), prompt_logprobs=prompt),
              TokenChunk((5,), (0.5,)), done]
    merged = merge_chunks(events)
    assert merged[0] == TokenChunk((1, 2, 3, 6), (0.1, 0.2, 0.3, 0.6), (top,) * 4, 4, 8)
    assert merged[1:] == [events[3], events[4], done]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def _job(num_top_logprobs=None) -> GenerationJob:
    request = GenerateRequest("r", (1, 2), SamplingParams(), StoppingCriteria(max_tokens=8))
    return GenerationJob(request=request, eos_token_ids=frozenset({99}), num_top_logprobs=num_top_logprobs)


async def _deltas(client, tokenizer, job) -> list[Delta]:
    detokenizer = IncrementalDetokenizer(tokenizer, job.prompt_token_ids)
    return [d async for d in generate_deltas(client, job, detokenizer, keepalive_s=5.0)]


async def test_chunks_that_piled_up_come_out_as_one_delta_with_the_same_text_and_logprobs(tiny_tokenizer):
    ids = tiny_tokenizer("Hello 🙂 world, again", add_special_tokens=False).input_ids
    chunks = [TokenChunk((t,), (-0.5 - i,), batch_size=i + 1) for i, t in enumerate(ids)] + [TokenChunk((99,), (0.0,))]
    events = [*chunks, GenerateComplete(FinishReason.EOS_TOKEN, 2, len(ids) + 1)]
    piled = await _deltas(ScriptedClient(events), tiny_tokenizer, _job(num_top_logprobs=0))
    one_by_one = await _deltas(ScriptedClient(events, delay_s=0.01), tiny_tokenizer, _job(num_top_logprobs=0))
    assert len(one_by_one) == len(chunks) + 1 and len(piled) < len(one_by_one)
    for deltas in (piled, one_by_one):
        assert "".join(d.text for d in deltas) == tiny_tokenizer.decode(ids)
        assert [t for d in deltas for t in d.token_ids] == [*ids, 99]
        assert [lp.logprob for d in deltas for lp in d.logprobs] == [c.scores[0] for c in chunks]
        assert sum(d.num_tokens for d in deltas) == len(ids) + 1
        assert deltas[-1].finish_reason == "stop" and deltas[-1].usage.completion_tokens == len(ids) + 1
    assert piled[0].batch_size == len(ids)  # the newest reported figure (the EOS chunk reports none)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3])
def test_prebuilt_text_chunks_are_byte_for_byte_the_models_json(text, index):
    completion = CompletionRenderer("cmpl-1", 1700000000, "m", None, False, 4)
    assert completion.chunk(Delta(text=text, index=index)) == completion._body(
        [CompletionChoice(index=index, text=text)]).model_dump_json()
    chat = ChatRenderer("chatcmpl-1", 1700000000, "m", None, False, 4)
    assert chat.chunk(Delta(text=text, index=index)) == chat._chunk(
        [ChatStreamChoice(index=index, delta=ChatDelta(content=text))]).model_dump_json()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("version", [None, "2"])
def test_prebuilt_v2_events_are_byte_for_byte_the_models_json(text, version):
    renderer = V2Renderer("gen-1", "m", version, 0.0, is_details=False, is_perf_stat=False)
    assert renderer.chunk(Delta(text=text, num_tokens=1)) == renderer._body(text, None).model_dump_json()


def test_the_rust_decoder_is_used_only_where_it_decodes_like_transformers(tiny_tokenizer, default_model_dir):
    gemma = AutoTokenizer.from_pretrained(str(default_model_dir))
    for tokenizer in (tiny_tokenizer, gemma):
        decode = backend_decoder(tokenizer)
        ids = tokenizer("Hello 🙂 東京 <eos> Übermäßig  spaced", add_special_tokens=True).input_ids
        if decode is None:
            continue
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert backend_decoder(gemma) is not None

    gemma.clean_up_tokenization_spaces = True
    assert backend_decoder(gemma) is None
    assert backend_decoder(object()) is None
