from protos.segserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftQuery(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "num_tokens", "num_prompt_tokens", "max_nodes", "num_known_tokens", "is_final", "tenant", "corpus_key", "min_node_prob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_KNOWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CORPUS_KEY_FIELD_NUMBER: _ClassVar[int]
    MIN_NODE_PROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    num_prompt_tokens: int
    max_nodes: int
    num_known_tokens: int
    is_final: bool
    tenant: str
    corpus_key: str
    min_node_prob: float
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., max_nodes: _Optional[int] = ..., num_known_tokens: _Optional[int] = ..., is_final: _Optional[bool] = ..., tenant: _Optional[str] = ..., corpus_key: _Optional[str] = ..., min_node_prob: _Optional[float] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("queries", "finished_request_ids")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[DraftQuery]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queries: _Optional[_Iterable[_Union[DraftQuery, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("request_id", "tree", "segment", "needs_resync", "marker_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NEEDS_RESYNC_FIELD_NUMBER: _ClassVar[int]
    MARKER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _common_pb2.CandidateTree
    segment: str
    needs_resync: bool
    marker_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.CandidateTree, _Mapping]] = ..., segment: _Optional[str] = ..., needs_resync: _Optional[bool] = ..., marker_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[DraftReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[DraftReply, _Mapping]]] = ...) -> None: ...

class DrafterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterSegmentStats(_message.Message):
    __slots__ = ("segment", "num_corpus_entries", "num_corpus_bytes", "num_requests", "num_learned_tokens", "sources")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_CORPUS_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_CORPUS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEARNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    num_corpus_entries: int
    num_corpus_bytes: int
    num_requests: int
    num_learned_tokens: int
    sources: _containers.RepeatedCompositeFieldContainer[DrafterSourceStats]
    def __init__(self, segment: _Optional[str] = ..., num_corpus_entries: _Optional[int] = ..., num_corpus_bytes: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_learned_tokens: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[DrafterSourceStats, _Mapping]]] = ...) -> None: ...

class DrafterSourceStats(_message.Message):
    __slots__ = ("source", "num_judged", "num_matched")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_JUDGED_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    source: str
    num_judged: int
    num_matched: int
    def __init__(self, source: _Optional[str] = ..., num_judged: _Optional[int] = ..., num_matched: _Optional[int] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("segments", "num_requests", "num_draft_calls", "cpu_seconds", "backend")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[DrafterSegmentStats]
    num_requests: int
    num_draft_calls: int
    cpu_seconds: float
    backend: str
    def __init__(self, segments: _Optional[_Iterable[_Union[DrafterSegmentStats, _Mapping]]] = ..., num_requests: _Optional[int] = ..., num_draft_calls: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., backend: _Optional[str] = ...) -> None: ...
