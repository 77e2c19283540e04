from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutingSettings(_message.Message):
    __slots__ = ("knobs",)
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    knobs: _containers.ScalarMap[str, str]
    def __init__(self, knobs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetRoutingRequest(_message.Message):
    __slots__ = ("routing",)
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    routing: RoutingSettings
    def __init__(self, routing: _Optional[_Union[RoutingSettings, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("name", "address", "healthy", "in_flight_requests", "in_flight_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "request_overhead_ms", "answers_learnt", "leaving")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_LEARNT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    healthy: bool
    in_flight_requests: int
    in_flight_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    request_overhead_ms: float
    answers_learnt: int
    leaving: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight_requests: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., request_overhead_ms: _Optional[float] = ..., answers_learnt: _Optional[int] = ..., leaving: _Optional[str] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("routing", "replicas", "in_flight_requests", "in_flight_tokens", "decisions")
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    routing: RoutingSettings
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    in_flight_requests: int
    in_flight_tokens: int
    decisions: int
    def __init__(self, routing: _Optional[_Union[RoutingSettings, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ..., in_flight_requests: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., decisions: _Optional[int] = ...) -> None: ...

class PlacementsRequest(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class ConversationPlacement(_message.Message):
    __slots__ = ("key", "opening", "prompt_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OPENING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: int
    opening: str
    prompt_tokens: int
    def __init__(self, key: _Optional[int] = ..., opening: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class PlacementsReply(_message.Message):
    __slots__ = ("conversations",)
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[ConversationPlacement]
    def __init__(self, conversations: _Optional[_Iterable[_Union[ConversationPlacement, _Mapping]]] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("key", "replica", "tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: int
    replica: str
    tokens: int
    def __init__(self, key: _Optional[int] = ..., replica: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class MigratedRequest(_message.Message):
    __slots__ = ("moves", "attempted", "failed", "bytes", "seconds", "drained")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    attempted: int
    failed: int
    bytes: int
    seconds: float
    drained: str
    def __init__(self, moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., attempted: _Optional[int] = ..., failed: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., drained: _Optional[str] = ...) -> None: ...

class MigratedReply(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...

class LeavingRequest(_message.Message):
    __slots__ = ("replica", "seconds", "near_seconds")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEAR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    seconds: float
    near_seconds: float
    def __init__(self, replica: _Optional[str] = ..., seconds: _Optional[float] = ..., near_seconds: _Optional[float] = ...) -> None: ...

class LeavingReply(_message.Message):
    __slots__ = ("idle", "in_flight")
    IDLE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    idle: int
    in_flight: int
    def __init__(self, idle: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...
