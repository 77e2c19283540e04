"""The shared store's layout (store.py): its keys, and its entries as a router reads them, each
checked: an entry that does not parse, or claims more than a router could publish, is skipped
and counted (``llm_ring_store_invalid_entries_total``), never fatal. Pure: no I/O."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import orjson

from extproc.envoy.contract import STREAM_IDLE_TIMEOUT_S
from extproc.routing.peers import PeerRequest, ReplicaLoads
from extproc.routing.placement import Placement
from extproc.routing.speeds import AnswerTimings
from extproc.service.metrics import Metrics

PENDING_TTL_MS = 2 * STREAM_IDLE_TIMEOUT_S * 1000  # no request stays pending longer (lifecycle.LOST_AFTER_S)
MAX_PENDING = 256  # a conversation's pending requests read per decision
MAX_NAME_CHARS = 253  # a replica name (a DNS name at most) or a router id
MAX_ANSWERS_PER_ENTRY = 4096  # answers read of one entry
MAX_ANSWER_MS = PENDING_TTL_MS  # no answer takes longer (the pending TTL)


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys under store.key_prefix (store.py says what each holds)."""

    routers: str
    present: str
    answers: str
    place_prefix: str
    pending_prefix: str
    load_prefix: bytes
    index_prefix: bytes

    @classmethod
    def under(cls, prefix: str) -> Keys:
        return cls(f"{prefix}:routers", f"{prefix}:present", f"{prefix}:answers", f"{prefix}:place:",
                   f"{prefix}:pending:", f"{prefix}:load:".encode(), f"{prefix}:index:".encode())

    def load(self, router: bytes) -> bytes:
        return self.load_prefix + router

    def place(self, suffix: str) -> str:
        return self.place_prefix + suffix

    def pending(self, suffix: str) -> str:
        return self.pending_prefix + suffix


@dataclass(frozen=True, slots=True)
class EntryBounds:
    """The most a real router can publish: beyond it an entry read from the store is forged or
    corrupt, and skipped."""

    max_peer_requests: int  # store.max_peer_requests: one router's requests in flight on one replica
    max_request_tokens: int  # one request's charged tokens: the largest prompt plus the largest output


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the store holds for one decision (peers.peer_view makes it a PeerView)."""

    placement: Placement | None
    digest: int  # the history digest of the request that left ``placement`` (0: none)
    pending: tuple[PeerRequest, ...]
    loads: dict[str, ReplicaLoads]  # other live routers -> replica -> (requests, tokens)


class EntryChecks:
    """Entries read from the store, parsed and held to ``bounds``; what is refused is counted."""

    def __init__(self, bounds: EntryBounds, metrics: Metrics) -> None:
        self.bounds = bounds
        self.metrics = metrics

    def snapshot(
        self, raw_placement: bytes | None, raw_pending: dict[bytes, bytes], raw_loads: dict[bytes, object]
    ) -> Snapshot:
        """What was read, every entry checked: what does not parse or is out of bounds is skipped
        and counted, never fatal."""
        placement, digest, pending, loads = None, 0, [], {}
        if raw_placement is not None:
            try:
                placement, digest = self.placement(raw_placement)
            except (ValueError, TypeError):
                self.metrics.store_invalid["placement"] += 1
        for value in itertools.islice(raw_pending.values(), MAX_PENDING):
            try:
                pending.append(self.pending(value))
            except (ValueError, TypeError):
                self.metrics.store_invalid["pending"] += 1
        for router, latest in raw_loads.items():
            if latest == []:
                continue  # its load key is gone: it left
            try:  # an error reply (a key of another type) is no list: TypeError
                loads[name(router)] = self.loads(latest[0])  # type: ignore[index]
            except (ValueError, TypeError, UnicodeDecodeError):
                self.metrics.store_invalid["load"] += 1
        return Snapshot(placement, digest, tuple(pending), loads)

    def answers(self, raw: bytes) -> list[tuple[str, AnswerTimings]]:
        answers = orjson.loads(raw)
        if not isinstance(answers, list) or len(answers) > MAX_ANSWERS_PER_ENTRY:
            raise TypeError("answers are a list")
        limit = self.bounds.max_request_tokens
        return [(name(replica), AnswerTimings(_count(prompt_n, limit), _ms(prompt_ms),
                                              _count(predicted_n, limit), _ms(predicted_ms),
                                              _count(cache_n, limit)))
                for replica, prompt_n, prompt_ms, predicted_n, predicted_ms, cache_n in answers]

    def placement(self, raw: bytes) -> tuple[Placement, int]:
        replica, tokens, digest = orjson.loads(raw)
        return Placement(name(replica), _count(tokens, self.bounds.max_request_tokens)), _digest(digest)

    def pending(self, raw: bytes) -> PeerRequest:
        router, replica, charged, prompt, history = orjson.loads(raw)
        limit = self.bounds.max_request_tokens
        return PeerRequest(name(router), name(replica), _count(charged, limit), _count(prompt, limit),
                           _digest(history))

    def loads(self, raw: bytes) -> ReplicaLoads:
        by_replica = orjson.loads(raw)
        if not isinstance(by_replica, dict):
            raise TypeError("a load is an object")
        loads = {}
        for replica, (requests, tokens) in by_replica.items():
            requests = _count(requests, self.bounds.max_peer_requests)
            loads[name(replica)] = (requests, _count(tokens, requests * self.bounds.max_request_tokens))
        return loads


def name(value: object) -> str:
    """A replica's name or a router's id, as read."""
    text = value.decode() if isinstance(value, bytes) else value
    if not isinstance(text, str) or not 0 < len(text) <= MAX_NAME_CHARS:
        raise ValueError("not a name")
    return text


def _count(value: object, limit: int) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise ValueError(f"{value!r} is not a count within 0..{limit}")
    return value


def _ms(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_ANSWER_MS:
        raise ValueError(f"{value!r} is not a duration within 0..{MAX_ANSWER_MS} ms")
    return float(value)


def _digest(value: object) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise ValueError("not a 64-bit digest")
    return value
