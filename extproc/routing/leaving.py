"""The order of a replica's leaving: which conversation moves when, and where its follow-ups go (pure).

From the moment a replica starts leaving (a roll, a scale-in, a pod's drain) it takes no new
conversation but still serves the ones it holds, until their caches have moved:

- a conversation with nothing in flight there is moved at once (``to_move``); one in flight
  is moved when its request ends (``ended``);
- until its cache has moved, its follow-ups go to the leaving replica, only there (a load cap
  does not send them away: it takes no new conversation, so its load only falls), unless the
  drain's deadline is near (``route``);
- once moved, its follow-ups go to the receiver, never cold to a third replica while that
  warm copy exists (a follow-up that ran on the leaving replica during the move makes the copy
  stale: it is moved again, to the same receiver, when that request ends);
- at the deadline, what is unmoved is counted (``expire``).

Every step is recorded with its time (``phases``), for the decision trace and run.json.
The local stack, the routing service and the simulator drive this same object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class State(Enum):
    IDLE = "idle"  # held here, nothing in flight: to move
    IN_FLIGHT = "in flight"  # a request of it runs here: moved when it ends
    MOVING = "moving"  # its slot is being saved and restored elsewhere
    MOVED = "moved"  # its cache is on the receiver
    UNMOVED = "unmoved"  # the deadline came, or its move failed: its next turn is computed again


class Phase(Enum):
    """Where a follow-up of a conversation the leaving replica held came, relative to its move."""

    BEFORE_MOVE = "before move"  # the cache still here only
    AFTER_MOVE = "after move"  # the cache on the receiver
    UNMOVED = "unmoved"  # no warm copy left anywhere once the replica goes
    AFTER_DOWN = "after down"  # the replica is gone


class Route(NamedTuple):
    """Where a follow-up may go: ``only`` (one replica, the warm copy) or anywhere but ``avoid``."""

    only: str | None
    avoid: frozenset[str]
    phase: Phase | None  # None: not a conversation of the leaving replica


@dataclass
class Leaving:
    replica: str
    began_s: float
    deadline_s: float
    near_s: float  # the deadline is near this long before it: follow-ups no longer come here
    states: dict[int, State] = field(default_factory=dict)
    receivers: dict[int, str] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)  # moved, then a follow-up ran here: to move again
    down_s: float | None = None
    events: list[tuple[float, int, str, str]] = field(default_factory=list)  # (s, key, what, replica)
    follow_ups: list[tuple[float, int, str, str]] = field(default_factory=list)  # (s, key, phase, sent to)

    @classmethod
    def begin(cls, replica: str, now: float, bound_s: float, near_s: float, idle: Iterable[int],
              in_flight: Iterable[int]) -> Leaving:
        """The replica starts leaving at ``now``, ``bound_s`` for all of it; the conversations it holds."""
        leaving = cls(replica, now, now + bound_s, min(near_s, bound_s))
        leaving.states.update((key, State.IDLE) for key in idle)
        leaving.states.update((key, State.IN_FLIGHT) for key in in_flight)
        return leaving

    def holds(self, key: int) -> bool:
        return key in self.states

    def near(self, now: float) -> bool:
        return now >= self.deadline_s - self.near_s

    def to_move(self) -> list[int]:
        """The conversations to move now (nothing of them in flight), marked as moving."""
        keys = [k for k, s in self.states.items() if s is State.IDLE or (s is State.MOVED and k in self.stale)]
        for key in keys:
            self.states[key] = State.MOVING
        return keys

    def moved(self, key: int, receiver: str, now: float) -> None:
        """The cache of ``key`` was restored on ``receiver`` (routers told)."""
        was = self.states.get(key)
        if was is None or was is State.UNMOVED:
            return
        self.stale.discard(key)
        self.receivers[key] = receiver
        if was is State.IN_FLIGHT:  # a follow-up runs here during the move: the copy will lack its turn
            self.stale.add(key)
        else:
            self.states[key] = State.MOVED
        self.events.append((now, key, "moved", receiver))

    def failed(self, key: int, now: float) -> None:
        """Its move failed: a miss (a moved one keeps its earlier copy)."""
        if self.states.get(key) is not State.MOVING:
            return
        if key in self.receivers:  # a refresh failed: the earlier copy stays its warmest
            self.states[key] = State.MOVED
            self.stale.discard(key)
        else:
            self.states[key] = State.UNMOVED
            self.events.append((now, key, "failed", self.replica))

    def route(self, key: int, now: float) -> Route:
        """Where a follow-up of ``key`` arriving at ``now`` may go (the caller routes it, then ``sent``)."""
        state = self.states.get(key)
        leaving_out = frozenset((self.replica,))
        if state is None:
            return Route(None, leaving_out, None)
        if self.down_s is not None:
            return Route(self.receivers.get(key), leaving_out, Phase.AFTER_DOWN)
        if key in self.receivers:
            return Route(self.receivers[key], leaving_out, Phase.AFTER_MOVE)
        if state is State.UNMOVED or self.near(now):
            return Route(None, leaving_out, Phase.UNMOVED)
        return Route(self.replica, frozenset(), Phase.BEFORE_MOVE)

    def sent(self, key: int, replica: str, now: float) -> None:
        """A follow-up of ``key`` went to ``replica`` at ``now``."""
        route = self.route(key, now)
        if route.phase is None:
            return
        self.follow_ups.append((now, key, route.phase.value, replica))
        if replica == self.receivers.get(key):  # its turn now there: the copy here is older
            self.stale.discard(key)
        elif replica == self.replica and self.down_s is None:
            self.states[key] = State.IN_FLIGHT
        elif key not in self.receivers and self.states[key] is not State.MOVING:
            # served cold elsewhere: its cache here is no longer its latest
            self.states[key] = State.UNMOVED
            self.events.append((now, key, "left cold", replica))

    def ended(self, key: int) -> None:
        """A request of ``key`` ended on the leaving replica: to move (again, if moved already)."""
        if self.states.get(key) is not State.IN_FLIGHT:
            return
        self.states[key] = State.MOVED if key in self.receivers else State.IDLE

    def expire(self, now: float) -> list[int]:
        """The deadline: what is not moved is counted as unmoved (returned) and not moved any more."""
        unmoved = sorted(k for k in self.states if k not in self.receivers)
        for key in unmoved:
            if self.states[key] is not State.UNMOVED:
                self.events.append((now, key, "unmoved at deadline", self.replica))
            self.states[key] = State.UNMOVED
        for key in self.receivers:  # a copy, if an older one, is on its receiver
            self.states[key] = State.MOVED
        self.stale.clear()
        return unmoved

    def busy(self) -> bool:
        """Whether a request of one of its conversations still runs or a move is under way."""
        return any(s in (State.IN_FLIGHT, State.MOVING) for s in self.states.values())

    def went_down(self, now: float) -> list[int]:
        """The replica stopped: its unmoved conversations counted (``expire``)."""
        unmoved = self.expire(now)
        self.down_s = now
        return unmoved

    def phases(self) -> dict[str, object]:
        """For the trace and run.json: when it left, each move, when it went down, each follow-up."""
        return {"replica": self.replica, "left_s": self.began_s, "deadline_s": self.deadline_s,
                "down_s": self.down_s, "events": [list(e) for e in self.events],
                "follow_ups": [list(f) for f in self.follow_ups],
                "unmoved": sorted(k for k, s in self.states.items() if s is State.UNMOVED)}
