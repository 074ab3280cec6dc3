from protos.segserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "num_prompt_tokens", "prompt_token_ids", "is_drafting_forced_spans")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFTING_FORCED_SPANS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    sampling: _common_pb2.SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    is_drafting_forced_spans: bool
    def __init__(self, seq_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., is_drafting_forced_spans: _Optional[bool] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_computed_tokens", "block_table", "sample_indices", "draft", "is_continuation", "block_table_start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    IS_CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_START_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    draft: _common_pb2.CandidateTree
    is_continuation: bool
    block_table_start: int
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample_indices: _Optional[_Iterable[int]] = ..., draft: _Optional[_Union[_common_pb2.CandidateTree, _Mapping]] = ..., is_continuation: _Optional[bool] = ..., block_table_start: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("new_sequences", "sequences", "finished_seq_ids", "step_id", "follows_step_id", "packed_sequences", "num_steps", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    sequences: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    step_id: int
    follows_step_id: int
    packed_sequences: PackedSequences
    num_steps: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[str]] = ..., step_id: _Optional[int] = ..., follows_step_id: _Optional[int] = ..., packed_sequences: _Optional[_Union[PackedSequences, _Mapping]] = ..., num_steps: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PackedSequences(_message.Message):
    __slots__ = ("seq_ids", "num_computed_tokens", "num_token_ids", "token_ids", "num_blocks", "block_tables", "num_sample_indices", "sample_indices", "continuations", "drafted", "drafts", "block_table_starts")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_STARTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedScalarFieldContainer[int]
    num_sample_indices: _containers.RepeatedScalarFieldContainer[int]
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    continuations: _containers.RepeatedScalarFieldContainer[int]
    drafted: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedCompositeFieldContainer[_common_pb2.CandidateTree]
    block_table_starts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[int]] = ..., num_sample_indices: _Optional[_Iterable[int]] = ..., sample_indices: _Optional[_Iterable[int]] = ..., continuations: _Optional[_Iterable[int]] = ..., drafted: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[_Union[_common_pb2.CandidateTree, _Mapping]]] = ..., block_table_starts: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("seq_id", "token_ids", "scores", "top_logprobs", "prompt_logprobs", "error", "forced_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _common_pb2.PromptLogprobs
    error: str
    forced_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., error: _Optional[str] = ..., forced_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("outputs", "compute_us", "packed_outputs")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    PACKED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    compute_us: int
    packed_outputs: PackedOutputs
    def __init__(self, outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., compute_us: _Optional[int] = ..., packed_outputs: _Optional[_Union[PackedOutputs, _Mapping]] = ...) -> None: ...

class PackedOutputs(_message.Message):
    __slots__ = ("seq_ids", "num_token_ids", "token_ids", "scores")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...
