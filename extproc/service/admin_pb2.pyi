from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutingSettings(_message.Message):
    __slots__ = ("policy", "virtual_nodes", "hash_seed", "epsilon", "load_unit", "cache_aware", "placement_memory", "long_stickiness", "long_prompt_tokens", "long_load_factor", "memory_capacity", "prefix_index", "prefix_feedback", "prefix_capacity_tokens", "ttft_decisions", "ttft_margin", "ttft_recompute_cost", "ttft_guard_factor", "replica_slots", "speed_learning", "speed_ewma_weight", "prior_prefill_tokens_per_s", "prior_decode_tokens_per_s", "prior_request_overhead_ms")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_NODES_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    LOAD_UNIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_AWARE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LONG_STICKINESS_FIELD_NUMBER: _ClassVar[int]
    LONG_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONG_LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MARGIN_FIELD_NUMBER: _ClassVar[int]
    TTFT_RECOMPUTE_COST_FIELD_NUMBER: _ClassVar[int]
    TTFT_GUARD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPEED_LEARNING_FIELD_NUMBER: _ClassVar[int]
    SPEED_EWMA_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIOR_PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PRIOR_DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PRIOR_REQUEST_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    virtual_nodes: int
    hash_seed: int
    epsilon: float
    load_unit: str
    cache_aware: bool
    placement_memory: bool
    long_stickiness: bool
    long_prompt_tokens: int
    long_load_factor: float
    memory_capacity: int
    prefix_index: bool
    prefix_feedback: bool
    prefix_capacity_tokens: int
    ttft_decisions: bool
    ttft_margin: float
    ttft_recompute_cost: bool
    ttft_guard_factor: float
    replica_slots: int
    speed_learning: bool
    speed_ewma_weight: float
    prior_prefill_tokens_per_s: float
    prior_decode_tokens_per_s: float
    prior_request_overhead_ms: float
    def __init__(self, policy: _Optional[str] = ..., virtual_nodes: _Optional[int] = ..., hash_seed: _Optional[int] = ..., epsilon: _Optional[float] = ..., load_unit: _Optional[str] = ..., cache_aware: _Optional[bool] = ..., placement_memory: _Optional[bool] = ..., long_stickiness: _Optional[bool] = ..., long_prompt_tokens: _Optional[int] = ..., long_load_factor: _Optional[float] = ..., memory_capacity: _Optional[int] = ..., prefix_index: _Optional[bool] = ..., prefix_feedback: _Optional[bool] = ..., prefix_capacity_tokens: _Optional[int] = ..., ttft_decisions: _Optional[bool] = ..., ttft_margin: _Optional[float] = ..., ttft_recompute_cost: _Optional[bool] = ..., ttft_guard_factor: _Optional[float] = ..., replica_slots: _Optional[int] = ..., speed_learning: _Optional[bool] = ..., speed_ewma_weight: _Optional[float] = ..., prior_prefill_tokens_per_s: _Optional[float] = ..., prior_decode_tokens_per_s: _Optional[float] = ..., prior_request_overhead_ms: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("name", "address", "healthy", "in_flight_requests", "in_flight_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "request_overhead_ms", "answers_learnt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_LEARNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    healthy: bool
    in_flight_requests: int
    in_flight_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    request_overhead_ms: float
    answers_learnt: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight_requests: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., request_overhead_ms: _Optional[float] = ..., answers_learnt: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("moves", "attempted", "failed", "bytes", "seconds")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    attempted: int
    failed: int
    bytes: int
    seconds: float
    def __init__(self, moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., attempted: _Optional[int] = ..., failed: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class MigratedReply(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...
