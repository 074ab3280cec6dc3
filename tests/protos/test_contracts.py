"""The contract types beside the protos: each round-trips through its proto form, and validate() owns the ranges.

Property tests (hypothesis): any value of a contract type survives to_pb -> wire
bytes -> from_pb unchanged; validate() accepts exactly the values inside RANGES
and refuses non-finite numbers, naming the field.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.segserve.v1 import common_pb2, scheduler_pb2, worker_pb2
from protos.segserve.v1.generate import (
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateRequest,
    MalformedEvents,
    TokenChunk,
    event_from_pb,
    stream_events_from_pb,
    stream_events_to_pb,
    validate_request,
)
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.sampling import (
    FLOAT32_MAX,
    RANGES,
    InvalidParameter,
    SamplingParams,
    StoppingCriteria,
    StructuredKind,
    StructuredOutput,
    validate,
)
from protos.segserve.v1.step import (
    MalformedStep,
    NewSequence,
    ScheduledSequence,
    StepRequest,
)
from protos.segserve.v1.step_result import (
    PromptLogprobs,
    SequenceOutput,
    StepResult,
    TopLogprobs,
    output_problem,
)
from protos.segserve.v1.stats import DrafterReplicaStats, DrafterSegmentStats, DrafterStats
from protos.segserve.v1.tree import ROOT, CandidateTree

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
token_ids = st.lists(uint32, max_size=8).map(tuple)
doubles = st.floats(allow_nan=False, allow_infinity=True)
# Values the wire carries as float (logprobs, scores) must be float32-exact to round-trip.
float32s = st.floats(width=32, allow_nan=False)


@st.composite
def trees(draw, max_size: int = 8) -> CandidateTree:
    size = draw(st.integers(0, max_size))
    parents = [draw(st.integers(ROOT, index - 1)) for index in range(size)]
    return CandidateTree(tuple(draw(st.lists(uint32, min_size=size, max_size=size))), tuple(parents))


sampling_params = st.builds(
    SamplingParams, do_sample=st.booleans(), temperature=doubles, top_k=uint32, top_p=doubles, typical_p=doubles,
    repetition_penalty=doubles, frequency_penalty=doubles, presence_penalty=doubles, seed=st.none() | uint64,
    num_top_logprobs=uint32, num_prompt_logprobs=st.none() | uint32, watermark=st.booleans(),
    logit_bias=st.dictionaries(uint32, doubles, max_size=4),
    structured_output=st.none() | st.builds(StructuredOutput, st.sampled_from(StructuredKind), st.text()))
stopping = st.builds(StoppingCriteria, max_tokens=uint32, stop_token_ids=token_ids, ignore_eos=st.booleans())
top_logprobs = st.integers(0, 4).flatmap(lambda n: st.builds(
    TopLogprobs, st.lists(uint32, min_size=n, max_size=n), st.lists(float32s, min_size=n, max_size=n)))
prompt_logprobs = st.builds(PromptLogprobs, uint32, st.lists(float32s, max_size=4),
                            st.lists(top_logprobs, max_size=3))
worker_infos = st.builds(WorkerInfo, st.text(), uint32, uint32, uint32, uint32, token_ids, st.text(), st.text(),
                         st.booleans(), st.booleans())


def wire(message):
    """Through bytes, as a peer would receive it."""
    return type(message).FromString(message.SerializeToString())


@given(sampling_params)
def test_sampling_params_round_trip(params):
    assert SamplingParams.from_pb(wire(params.to_pb())) == params


@pytest.mark.parametrize("kind, spec", [
    (StructuredKind.JSON_OBJECT, "{}"), (StructuredKind.REGEX, ""), (StructuredKind.GRAMMAR, ""),
    (StructuredKind.JSON_SCHEMA, "not json"), (StructuredKind.JSON_SCHEMA, "[1]"), (StructuredKind.CHOICE, "[]"),
    (StructuredKind.CHOICE, '["a", ""]'), (StructuredKind.CHOICE, '{"a": 1}'), (None, "x"),
])
def test_validate_refuses_a_malformed_structured_output(kind, spec):
    with pytest.raises(InvalidParameter) as caught:
        validate(SamplingParams(structured_output=StructuredOutput(kind, spec)))
    assert caught.value.field == "structured_output"


@pytest.mark.parametrize("kind, spec", [
    (StructuredKind.JSON_OBJECT, ""), (StructuredKind.REGEX, "[a-z]+"), (StructuredKind.GRAMMAR, 'root ::= "a"'),
    (StructuredKind.JSON_SCHEMA, '{"type": "object"}'), (StructuredKind.JSON_SCHEMA, "true"),
    (StructuredKind.CHOICE, '["yes", "no"]'),
])
def test_validate_accepts_a_well_formed_structured_output(kind, spec):
    validate(SamplingParams(structured_output=StructuredOutput(kind, spec)))


def test_an_unknown_structured_kind_is_refused_on_arrival():
    pb = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(kind=0, spec="x"))
    with pytest.raises(InvalidParameter) as caught:
        SamplingParams.from_pb(wire(pb))
    assert caught.value.field == "structured_output"


@given(stopping)
def test_stopping_round_trip(criteria):
    assert StoppingCriteria.from_pb(wire(criteria.to_pb())) == criteria


@given(st.text(), token_ids, sampling_params, stopping)
def test_generate_request_round_trip(request_id, prompt, params, criteria):
    request = GenerateRequest(request_id, prompt, params, criteria)
    assert GenerateRequest.from_pb(wire(request.to_pb())) == request


@given(st.dictionaries(st.text(), st.text(), max_size=3))
def test_a_trace_context_round_trips_with_its_request_and_its_step(context):
    request = GenerateRequest("r", (1,), trace_context=tuple(sorted(context.items())))
    assert GenerateRequest.from_pb(wire(request.to_pb())) == request
    step = StepRequest(trace_context=dict(context))
    assert StepRequest.from_pb(wire(step.to_pb())) == step
    assert StepRequest.from_pb(wire(step.to_pb(packed=True))) == step
    if not context:  # an untraced request or step puts no byte of it on the wire
        assert request.to_pb().ByteSize() == GenerateRequest("r", (1,)).to_pb().ByteSize()
        assert not step.to_pb().trace_context


def test_generate_request_without_sampling_is_greedy_defaults():
    pb = scheduler_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1], stopping=common_pb2.StoppingCriteria(
        max_tokens=3))
    assert GenerateRequest.from_pb(pb).sampling == SamplingParams()


generate_events = st.one_of(
    st.builds(TokenChunk, token_ids, st.lists(float32s, max_size=8), st.lists(top_logprobs, max_size=3), uint32,
              uint64, st.none() | prompt_logprobs, st.text(), uint32, uint32, uint32),
    st.builds(GenerateComplete, st.sampled_from(FinishReason), uint32, uint32, uint64, uint64, uint64, uint32,
              st.text(), uint32),
    st.builds(GenerateError, st.text(min_size=1), st.text()))
plain_chunks = st.integers(0, 6).flatmap(lambda n: st.builds(
    TokenChunk, st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n), st.lists(float32s, min_size=n, max_size=n),
    st.just(()), uint32, st.just(0) | uint64, st.none(), st.just("") | st.text(), st.just(0) | uint32, uint32, uint32))


@given(generate_events)
def test_generate_events_round_trip(event):
    assert event_from_pb(wire(event.to_pb())) == event


def _by_request(events: list) -> dict[str, list]:
    by_request: dict[str, list] = {}
    for request_id, event in events:
        by_request.setdefault(request_id, []).append(event)
    return by_request


@settings(max_examples=80)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), plain_chunks | generate_events), max_size=12))
def test_a_streams_response_keeps_each_requests_events_in_order_packed_or_not(events):
    assert stream_events_from_pb(wire(stream_events_to_pb(events))) == events
    packed = wire(stream_events_to_pb(events, packed=True))
    assert _by_request(stream_events_from_pb(packed)) == _by_request(events)
    # a request's events go packed up to its first one that cannot, then one message each (a lone event: one)
    for request_id, own in _by_request(events).items():
        num_packed = next((i for i, e in enumerate(own) if not _is_packable(e)), len(own)) if len(events) > 1 else 0
        assert list(packed.packed_chunks.request_ids).count(request_id) == num_packed


def _is_packable(event) -> bool:
    return (isinstance(event, TokenChunk) and not event.top_logprobs and event.prompt_logprobs is None
            and len(event.scores) == len(event.token_ids))


def test_packed_chunks_leave_the_columns_of_fields_at_their_defaults_empty():
    events = [(f"r{i}", TokenChunk((i, i + 1), (0.5, -0.5), batch_size=4, queue_wait_us=120)) for i in range(3)]
    packed = stream_events_to_pb(events, packed=True).packed_chunks
    assert list(packed.batch_sizes) == [4] * 3 and not packed.segments and not packed.num_draft_tokens
    assert stream_events_from_pb(wire(scheduler_pb2.StreamsResponse(packed_chunks=packed))) == events


@pytest.mark.parametrize("columns, message", [
    ({"num_token_ids": [1]}, "1 num_token_ids for 2"),
    ({"token_ids": [7]}, "1 token_ids and 2 scores"),
    ({"scores": [0.5]}, "2 token_ids and 1 scores"),
    ({"batch_sizes": [1]}, "1 batch_sizes for 2"),
    ({"segments": ["x", "y", "z"]}, "3 segments for 2"),
], ids=["lengths", "tokens", "scores", "batch-sizes", "segments"])
def test_packed_chunks_whose_columns_disagree_are_malformed(columns, message):
    fields = {"request_ids": ["a", "b"], "num_token_ids": [1, 1], "token_ids": [7, 8], "scores": [0.5, 0.5],
              **columns}
    pb = scheduler_pb2.StreamsResponse(packed_chunks=scheduler_pb2.PackedChunks(**fields))
    with pytest.raises(MalformedEvents, match=message):
        stream_events_from_pb(wire(pb))


@given(trees())
def test_candidate_tree_round_trip(tree):
    assert CandidateTree.from_pb(wire(tree.to_pb())) == tree
    assert tree.problem() is None


@settings(max_examples=50)
@given(st.lists(st.builds(ScheduledSequence, st.text(), token_ids, uint32, token_ids, token_ids,
                          st.none() | trees().filter(len), st.booleans(), uint32), max_size=3),
       st.lists(st.builds(NewSequence, st.text(), sampling_params, uint32, token_ids, st.booleans()), max_size=3),
       st.lists(st.text(), max_size=3))
def test_step_request_round_trip(sequences, new_sequences, finished):
    request = StepRequest(sequences, new_sequences, finished)
    assert StepRequest.from_pb(wire(request.to_pb())) == request
    assert StepRequest.from_pb(wire(request.to_pb(packed=True))) == request


@settings(max_examples=50)
@given(st.lists(st.builds(ScheduledSequence, st.text(), token_ids, uint32, token_ids, token_ids,
                          st.none() | trees().filter(len), st.booleans(), st.just(0) | uint32), max_size=6),
       uint64, uint64)
def test_a_packed_step_request_keeps_every_sequence_in_order(sequences, step_id, follows_step_id):
    request = StepRequest(sequences, step_id=step_id, follows_step_id=follows_step_id)
    pb = wire(request.to_pb(packed=True))
    assert pb.HasField("packed_sequences") and not pb.sequences
    assert StepRequest.from_pb(pb) == request


def _packed_step(**columns) -> worker_pb2.StepRequest:
    """A packed step of two sequences, one token, one block and one sample index each, with `columns` replaced."""
    fields = {"seq_ids": ["a", "b"], "num_computed_tokens": [3, 4], "num_token_ids": [1, 1], "token_ids": [7, 8],
              "num_blocks": [1, 1], "block_tables": [0, 1], "num_sample_indices": [1, 1], "sample_indices": [0, 0],
              **columns}
    return worker_pb2.StepRequest(packed_sequences=worker_pb2.PackedSequences(**fields))


def test_the_packed_step_helper_is_well_formed():
    assert [s.seq_id for s in StepRequest.from_pb(_packed_step()).sequences] == ["a", "b"]


@pytest.mark.parametrize("columns, message", [
    ({"num_computed_tokens": [3]}, "num_computed_tokens"),
    ({"num_token_ids": [1]}, "lengths of token_ids"),
    ({"token_ids": [7]}, "token_ids holds 1 values"),
    ({"num_blocks": [1, 2]}, "block_tables holds 2 values, its lengths sum to 3"),
    ({"sample_indices": [0, 0, 0]}, "sample_indices holds 3"),
    ({"continuations": [2]}, "continuations must be ascending indices below 2"),
    ({"continuations": [1, 1]}, "continuations"),
    ({"drafted": [0], "drafts": []}, "0 drafts for 1 drafted"),
    ({"drafted": [1, 0], "drafts": [common_pb2.CandidateTree(token_ids=[1], parents=[-1])] * 2}, "drafted"),
    ({"block_table_starts": [2]}, "1 block_table_starts for 2"),
], ids=["computed", "token-lengths", "token-values", "blocks", "samples", "continuation-range",
        "continuation-twice", "drafts-missing", "drafted-order", "table-starts"])
def test_a_packed_step_whose_columns_disagree_is_malformed(columns, message):
    with pytest.raises(MalformedStep, match=message):
        StepRequest.from_pb(wire(_packed_step(**columns)))


def test_a_packed_step_sends_the_block_table_starts_only_when_one_is_not_0():
    whole = ScheduledSequence("a", (1,), 4, (0,), (0,))
    delta = ScheduledSequence("b", (2,), 16, (), (0,), block_table_start=1)
    assert not StepRequest([whole, whole]).to_pb(packed=True).packed_sequences.block_table_starts
    pb = wire(StepRequest([whole, delta]).to_pb(packed=True))
    assert list(pb.packed_sequences.block_table_starts) == [0, 1]
    assert StepRequest.from_pb(pb).sequences == [whole, delta]


def test_a_step_with_sequences_both_packed_and_one_message_each_is_malformed():
    pb = _packed_step()
    pb.sequences.add(seq_id="c", token_ids=[1], block_table=[2])
    with pytest.raises(MalformedStep, match="both"):
        StepRequest.from_pb(pb)


@given(st.lists(st.builds(SequenceOutput, st.text(), token_ids, st.lists(float32s, max_size=8),
                          st.lists(top_logprobs, max_size=3), st.none() | prompt_logprobs, st.text(), token_ids),
                max_size=3),
       uint64)
def test_step_result_round_trip(outputs, compute_us):
    result = StepResult(outputs, compute_us)
    assert StepResult.from_pb(wire(result.to_pb())) == result
    # packed: the outputs of only tokens and a score each go as columns, after the others (order is not kept)
    packed = StepResult.from_pb(wire(result.to_pb(packed=True)))
    assert packed.compute_us == compute_us
    assert sorted(map(repr, packed.outputs)) == sorted(map(repr, outputs))


def test_packed_outputs_carry_plain_outputs_as_columns_and_the_rest_one_message_each():
    plain = [SequenceOutput("a", (1, 2), (-0.5, -1.0)), SequenceOutput("b", (3,), (-2.0,))]
    rich = [SequenceOutput("c", (4,), (-0.25,), (TopLogprobs((4, 5), (-0.25, -1.5)),)),
            SequenceOutput("d", error="non-finite logits"), SequenceOutput("e", (6,), (-0.5,), forced_token_ids=(7, 8))]
    pb = wire(StepResult([plain[0], *rich, plain[1]], 7).to_pb(packed=True))
    assert list(pb.packed_outputs.seq_ids) == ["a", "b"] and [o.seq_id for o in pb.outputs] == ["c", "d", "e"]
    assert StepResult.from_pb(pb) == StepResult([*rich, *plain], 7)


def test_joined_decode_steps_carry_the_forced_span_after_the_last():
    first = SequenceOutput("a", (1,), (-0.5,), forced_token_ids=(9,))
    joined = first.followed_by(SequenceOutput("a", (2,), (-0.25,), forced_token_ids=(3, 4)))
    assert joined.token_ids == (1, 2) and joined.forced_token_ids == (3, 4)
    assert first.followed_by(SequenceOutput("a", (2,), (-0.25,))).forced_token_ids == ()


def test_packed_outputs_whose_scores_do_not_match_their_tokens_are_malformed():
    pb = worker_pb2.StepResponse(packed_outputs=worker_pb2.PackedOutputs(
        seq_ids=["a"], num_token_ids=[2], token_ids=[1, 2], scores=[-0.5]))
    with pytest.raises(MalformedStep, match="scores holds 1 values, its lengths sum to 2"):
        StepResult.from_pb(pb)


@given(worker_infos, st.booleans(), st.text())
def test_info_and_health_round_trip(info, is_ready, detail):
    assert WorkerInfo.from_pb(wire(info.to_pb())) == info
    assert Health.from_pb(wire(Health(is_ready, detail).to_pb())) == Health(is_ready, detail)


drafter_stats = st.builds(DrafterStats, st.lists(st.builds(DrafterSegmentStats, st.text(), uint64, uint64, uint32),
                                                  max_size=3).map(tuple), uint32)


@given(st.text(), st.booleans(), st.none() | drafter_stats)
def test_drafter_stats_round_trip(address, is_live, stats):
    replica = DrafterReplicaStats(address, is_live, stats)
    assert DrafterReplicaStats.from_pb(wire(replica.to_pb())) == replica
    if stats is not None:
        assert DrafterStats.from_pb(wire(stats.to_pb())) == stats


def test_a_drafter_that_answered_nothing_is_told_from_one_with_empty_stats():
    silent, empty = DrafterReplicaStats("a:1", False), DrafterReplicaStats("a:1", True, DrafterStats())
    assert DrafterReplicaStats.from_pb(wire(silent.to_pb())).stats is None
    assert DrafterReplicaStats.from_pb(wire(empty.to_pb())).stats == DrafterStats()


FLOAT_FIELDS = ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e39, -1e39])
def test_validate_refuses_non_finite_numbers_naming_the_field(field, value):
    with pytest.raises(InvalidParameter) as caught:
        validate(SamplingParams(**{field: value}))
    assert caught.value.field == field
    assert field in str(caught.value)


@given(st.sampled_from(FLOAT_FIELDS), st.floats(allow_nan=True, allow_infinity=True))
def test_validate_accepts_exactly_the_documented_range(field, value):
    is_inside = math.isfinite(value) and abs(value) <= FLOAT32_MAX and RANGES[field].contains(value)
    try:
        validate(SamplingParams(**{field: value}))
    except InvalidParameter as exc:
        assert not is_inside, f"{field}={value!r} is inside {RANGES[field].describe()} but was refused: {exc}"
        assert exc.field == field
    else:
        assert is_inside, f"{field}={value!r} is outside {RANGES[field].describe()} but was accepted"


@pytest.mark.parametrize("params, field", [
    (SamplingParams(top_k=100), "top_k"),
    (SamplingParams(logit_bias={100: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
    (SamplingParams(logit_bias={3: math.nan}), "logit_bias"),
    (SamplingParams(seed=2**64), "seed"),
    (SamplingParams(seed=-1), "seed"),
    (SamplingParams(num_top_logprobs=21), "num_top_logprobs"),
    (SamplingParams(num_prompt_logprobs=21), "num_prompt_logprobs"),
    (SamplingParams(do_sample=1), "do_sample"),
    (SamplingParams(top_k=2.0), "top_k"),
    (SamplingParams(temperature="1"), "temperature"),
])
def test_validate_refuses_out_of_range_values(params, field):
    with pytest.raises(InvalidParameter) as caught:
        validate(params, vocab_size=100)
    assert caught.value.field == field


def test_validate_request_checks_the_prompt_and_stopping_against_the_model():
    info = WorkerInfo("m", 8, 16, 32, 100, (0,))
    good = GenerateRequest("r", (1, 2, 3), SamplingParams(), StoppingCriteria(max_tokens=4))
    validate_request(good, info)
    for request, field in [
        (GenerateRequest("", (1,)), "request_id"),
        (GenerateRequest("r", ()), "prompt_token_ids"),
        (GenerateRequest("r", (100,)), "prompt_token_ids"),
        (GenerateRequest("r", tuple(range(32))), "prompt_token_ids"),
        (GenerateRequest("r", (1,), stopping=StoppingCriteria(max_tokens=0)), "max_tokens"),
        (GenerateRequest("r", (1,), stopping=StoppingCriteria(stop_token_ids=(100,))), "stop_token_ids"),
        (GenerateRequest("r", (1,), SamplingParams(temperature=math.inf)), "temperature"),
    ]:
        with pytest.raises(InvalidParameter) as caught:
            validate_request(request, info)
        assert caught.value.field == field


def test_tree_problem_prune_and_path():
    tree = CandidateTree((5, 6, 7, 8), (ROOT, 0, 1, ROOT))
    assert tree.depths == (1, 2, 3, 1) and tree.max_depth == 3
    assert CandidateTree((5, 6), (ROOT, 1)).problem() is not None  # a parent must come first
    assert CandidateTree((5,), (ROOT, ROOT)).problem() is not None
    assert CandidateTree((500,), (ROOT,)).problem(vocab_size=100) is not None
    assert tree.problem(max_nodes=3) is not None
    assert tree.prune(max_nodes=3, max_depth=2) == CandidateTree((5, 6, 8), (ROOT, 0, ROOT))
    assert tree.is_path([5, 6, 7, 1]) and tree.is_path([8, 1]) and tree.is_path([2])
    assert not tree.is_path([6, 1])


def test_output_problem_checks_an_answer_against_its_work():
    plain = ScheduledSequence("a", (1,), 4, (0,), sample_indices=(0,))
    assert output_problem(plain, SequenceOutput("a", (3,), (0.5,))) is None
    assert output_problem(plain, None) is not None
    assert output_problem(plain, SequenceOutput("a", (3, 4), (0.5, 0.1))) is not None
    assert output_problem(plain, SequenceOutput("a", error="nan logits")) is None
    tree = ScheduledSequence("b", (1,), 4, (0,), draft=CandidateTree((5, 6), (ROOT, 0)))
    assert output_problem(tree, SequenceOutput("b", (5, 6, 9), (0.0,) * 3)) is None
    assert output_problem(tree, SequenceOutput("b", (6, 9), (0.0,) * 2)) is not None
    assert output_problem(ScheduledSequence("c", (1, 2), 0, (0,)), None) is None  # a prefill chunk: no answer due
    assert isinstance(worker_pb2.ScheduledSequence().draft, common_pb2.CandidateTree)


CONTRACT_CLASSES = {
    "SamplingParams", "StoppingCriteria", "GenerateRequest", "TokenChunk", "GenerateComplete", "GenerateError",
    "FinishReason", "NewSequence", "ScheduledSequence", "StepRequest", "SequenceOutput", "StepResult",
    "TopLogprobs", "PromptLogprobs", "CandidateTree", "WorkerInfo", "Health", "DrafterSegmentStats", "DrafterStats",
    "DrafterReplicaStats",
    # Former duplicates, under their old names: none may come back.
    "GenerateParams", "ModelInfo", "SampledTokens", "DraftTree", "WorkerHealth", "GenerateFailure",
}
ROOT_DIR = Path(__file__).resolve().parents[2]


def class_definitions(root: Path, packages: list[str]) -> dict[str, list[str]]:
    """Every `class X` among CONTRACT_CLASSES defined in the packages' sources, as name -> [file:line]."""
    found: dict[str, list[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name in CONTRACT_CLASSES:
                    found.setdefault(node.name, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_each_contract_type_is_defined_once_beside_the_protos():
    found = class_definitions(ROOT_DIR, ["protos", "router", "scheduler", "worker", "drafter", "segserve"])
    duplicates = {name: places for name, places in found.items()
                  if len(places) > 1 or not places[0].startswith("protos/")}
    assert not duplicates, f"contract types defined outside protos/segserve/v1 or twice: {duplicates}"


def test_the_definition_check_finds_a_copy(tmp_path: Path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "params.py").write_text("class SamplingParams:\n    pass\n")
    assert class_definitions(tmp_path, ["router"]) == {"SamplingParams": ["router/params.py:1"]}
