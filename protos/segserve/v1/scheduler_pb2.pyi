from protos.segserve.v1 import common_pb2 as _common_pb2
from protos.segserve.v1 import drafter_pb2 as _drafter_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_ERROR: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stopping", "tenant", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stopping: _common_pb2.StoppingCriteria
    tenant: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingCriteria, _Mapping]] = ..., tenant: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "scores", "top_logprobs", "batch_size", "queue_wait_us", "prompt_logprobs", "segment", "num_draft_tokens", "draft_depth", "num_accepted_draft_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    batch_size: int
    queue_wait_us: int
    prompt_logprobs: _common_pb2.PromptLogprobs
    segment: str
    num_draft_tokens: int
    draft_depth: int
    num_accepted_draft_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., batch_size: _Optional[int] = ..., queue_wait_us: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., segment: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., draft_depth: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("finish_reason", "num_prompt_tokens", "num_generated_tokens", "queue_wait_us", "first_token_us", "decode_us", "max_batch_size", "error_message", "num_cached_prompt_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    queue_wait_us: int
    first_token_us: int
    decode_us: int
    max_batch_size: int
    error_message: str
    num_cached_prompt_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., queue_wait_us: _Optional[int] = ..., first_token_us: _Optional[int] = ..., decode_us: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., error_message: _Optional[str] = ..., num_cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    complete: GenerateComplete
    error: GenerateError
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ...) -> None: ...

class StreamsRequest(_message.Message):
    __slots__ = ("start", "cancel_request_id", "packed_chunks")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    start: StartStream
    cancel_request_id: str
    packed_chunks: bool
    def __init__(self, start: _Optional[_Union[StartStream, _Mapping]] = ..., cancel_request_id: _Optional[str] = ..., packed_chunks: _Optional[bool] = ...) -> None: ...

class StartStream(_message.Message):
    __slots__ = ("request", "timeout_ms")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    timeout_ms: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("request_id", "event")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event: GenerateResponse
    def __init__(self, request_id: _Optional[str] = ..., event: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class StreamsResponse(_message.Message):
    __slots__ = ("events", "packed_chunks")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    packed_chunks: PackedChunks
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ..., packed_chunks: _Optional[_Union[PackedChunks, _Mapping]] = ...) -> None: ...

class PackedChunks(_message.Message):
    __slots__ = ("request_ids", "num_token_ids", "token_ids", "scores", "batch_sizes", "queue_wait_us", "segments", "num_draft_tokens", "draft_depths", "num_accepted_draft_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    queue_wait_us: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_depths: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., queue_wait_us: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_depths: _Optional[_Iterable[int]] = ..., num_accepted_draft_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_used_kv_blocks", "num_total_kv_blocks", "num_preemptions", "num_steps", "spec", "spec_segments", "num_prefix_cache_queries", "num_prefix_cache_hits", "num_workers", "num_live_workers", "num_moved_requests", "drafters")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_used_kv_blocks: int
    num_total_kv_blocks: int
    num_preemptions: int
    num_steps: int
    spec: SpecStats
    spec_segments: _containers.RepeatedCompositeFieldContainer[SpecStats]
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    num_workers: int
    num_live_workers: int
    num_moved_requests: int
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterReplicaStats]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_kv_blocks: _Optional[int] = ..., num_total_kv_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., spec_segments: _Optional[_Iterable[_Union[SpecStats, _Mapping]]] = ..., num_prefix_cache_queries: _Optional[int] = ..., num_prefix_cache_hits: _Optional[int] = ..., num_workers: _Optional[int] = ..., num_live_workers: _Optional[int] = ..., num_moved_requests: _Optional[int] = ..., drafters: _Optional[_Iterable[_Union[DrafterReplicaStats, _Mapping]]] = ...) -> None: ...

class DrafterReplicaStats(_message.Message):
    __slots__ = ("address", "is_live", "stats")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LIVE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    address: str
    is_live: bool
    stats: _drafter_pb2.DrafterStats
    def __init__(self, address: _Optional[str] = ..., is_live: _Optional[bool] = ..., stats: _Optional[_Union[_drafter_pb2.DrafterStats, _Mapping]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("segment", "num_verified", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate_by_depth", "num_accepted_by_depth", "is_drafting", "num_budget_nodes", "gate_batch_bucket", "is_gate_open")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_BY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_BY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFTING_FIELD_NUMBER: _ClassVar[int]
    NUM_BUDGET_NODES_FIELD_NUMBER: _ClassVar[int]
    GATE_BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    IS_GATE_OPEN_FIELD_NUMBER: _ClassVar[int]
    segment: str
    num_verified: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate_by_depth: _containers.RepeatedScalarFieldContainer[float]
    num_accepted_by_depth: _containers.RepeatedScalarFieldContainer[int]
    is_drafting: bool
    num_budget_nodes: int
    gate_batch_bucket: int
    is_gate_open: bool
    def __init__(self, segment: _Optional[str] = ..., num_verified: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., acceptance_rate_by_depth: _Optional[_Iterable[float]] = ..., num_accepted_by_depth: _Optional[_Iterable[int]] = ..., is_drafting: _Optional[bool] = ..., num_budget_nodes: _Optional[int] = ..., gate_batch_bucket: _Optional[int] = ..., is_gate_open: _Optional[bool] = ...) -> None: ...
