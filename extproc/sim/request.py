"""A simulated request, from its input to what happened to it, and the replica slot it holds."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from extproc.routing import RouteRequest, Ticket
from extproc.routing.flow_control import Wait
from extproc.routing.hashing import stable_hash
from extproc.sim.prompts import BLOCK_TOKENS


class Request:
    """One request through the whole simulation: its input, then what happened to it."""

    __slots__ = (
        "route", "request_id", "conversation", "turn", "key", "blocks", "prompt_tokens", "max_tokens", "arrival_s",
        "think_s", "next", "previous", "sides", "waiting", "head", "replica", "reason", "predicted_cached",
        "cache_n", "prompt_n", "arrived_at", "started_at", "first_token_at", "finished_at", "status", "error",
        "order", "target", "slot", "ticket", "tenant", "objective", "users", "wait", "history",
    )

    def __init__(
        self, request_id: str, conversation: str, turn: int, key: Hashable, blocks: tuple[int, ...] | None,
        prompt_tokens: int, max_tokens: int, arrival_s: float | None = None, think_s: float = 0.0,
    ) -> None:
        # built once, up front; block-aware policies see the trace's chained hashes of the full blocks
        full_blocks = blocks[: prompt_tokens // BLOCK_TOKENS] if blocks else ()
        self.route = RouteRequest(request_id, conversation, prompt_tokens, max_tokens, full_blocks)
        self.request_id = request_id
        # its body's history digest (continuation.py's, never 0: a chat): a next turn shows it answered
        self.history = stable_hash(request_id) or 1
        self.conversation = conversation
        self.turn = turn  # 1-based
        self.key = key
        self.blocks = blocks
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s  # open loop (traces): fixed arrival time
        self.think_s = think_s  # closed loop (profiles): pause after the previous turn's answer
        self.next: Request | None = None  # closed loop: the conversation's next turn
        self.previous: Request | None = None  # closed loop: the turn this one carries the answer of
        self.sides: tuple[Request, ...] = ()  # sent at the same moment on the same history (fan-out)
        self.waiting = 0  # with sides: requests of this turn not yet answered
        self.head: Request = self  # the turn a side belongs to (itself otherwise)
        self.ticket: Ticket | None = None  # the router's, from its decision to its release
        self.replica: str | None = None
        self.reason: str | None = None
        self.predicted_cached: int | None = None
        self.cache_n = 0
        self.prompt_n = 0
        self.arrived_at = 0.0
        self.started_at = 0.0
        self.first_token_at = 0.0
        self.finished_at = 0.0
        self.status = 0
        self.error: str | None = None
        self.order = 0  # the replica's start counter when it got a slot
        self.target = 0.0  # the replica's clock for its current phase when the phase is done
        self.slot: Slot | None = None
        self.tenant = ""  # whom it comes from and the objective it names (flow control's headers; "": none)
        self.objective = ""
        self.users: Iterator[Request] | None = None  # closed loop: the conversations its user takes next
        self.wait: Wait | None = None  # with flow control: how it went through the queue (its decision trace's)


class Slot:
    __slots__ = ("key", "blocks", "tokens", "last_used", "busy")

    def __init__(self) -> None:
        self.key: Hashable = None
        self.blocks: tuple[int, ...] | None = None
        self.tokens = 0
        self.last_used = -1.0
        self.busy = False
