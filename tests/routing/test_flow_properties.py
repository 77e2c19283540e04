"""Properties of the queue and of flow control, under any order of events (hypothesis):

- no credit for idling: a flow that starts waiting again starts at least at the least counter
  of the flows waiting in its band (VTC's lift);
- the deficit bound: a request is taken only when its flow's counter is at most the least
  counter of its band's flows that could go (a flow holding a request back for its cache holder
  included) plus ``locality_deficit``, so right after, the flow is at most
  ``locality_deficit + U`` ahead of any flow still waiting (U: one request's work);
- strict priority: nothing is taken from a band while a higher band has a request that could go;
- no starvation within a band: a waiting request goes within (F - 1) x (deficit / least work + 1)
  dispatches, F the band's flows, whatever the others send;
- work conservation: while a request waits, no replica it may go to has a slot it may take,
  unless its cache holder is full and it has waited less than that cache takes to compute again
  (its patience); and no replica ever runs more than its slots;
- TTL and size: nothing waits past its deadline once expired, no band holds more than its size;
- cancellation and the end of every request leave nothing: no counter, no charge, no load.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.routing import Router, RouteRequest
from extproc.routing.flow_control import FlowControl, Queued, Refused, Routed
from extproc.routing.flows import Flow
from extproc.routing.queue import FAIR, LOCAL, LOOKAHEAD, NEW, FairQueue, Waiting
from tests.routing.conftest import routing
from tests.routing.flow_support import flow_settings

REPLICAS = ("r0", "r1", "r2")
HOLDERS = st.sampled_from([None, "r0", "r1", "r2"])
WORK = st.integers(min_value=1, max_value=500)


def kind(holder: str | None, rooms: tuple[str, ...], patient: bool = False) -> int | None:
    """What flow control says of a request whose cache is on ``holder`` (None: nowhere); a
    ``patient`` one whose holder is full is held back (None: it waits for its holder)."""
    if patient and holder is not None and holder not in rooms:
        return None
    return LOCAL if holder in rooms else NEW if holder is None else FAIR


def waiting(rid: str, flow: Flow, arrived: float = 0.0) -> Waiting:
    return Waiting(RouteRequest(rid, rid, 10, 1), flow, frozenset(), arrived, arrived + 100.0)


@settings(max_examples=200)
@given(st.data(), st.floats(min_value=0, max_value=2000), st.integers(min_value=2, max_value=5))
def test_every_take_respects_the_deficit_bound_and_strict_priority(data: st.DataObject, deficit: float,
                                                                   tenants: int) -> None:
    turn_waits = data.draw(st.booleans())  # the bound holds with the least served flow's turn waiting too
    queue = FairQueue(band_size=1000, locality_deficit=deficit, turn_waits=turn_waits)
    holders: dict[str, str | None] = {}
    patient: dict[str, bool] = {}
    works: dict[str, int] = {}
    queued: dict[str, Flow] = {}  # waiting now, oldest first
    in_flight: list[Flow] = []
    largest = 0
    for step in range(data.draw(st.integers(min_value=5, max_value=60))):
        action = data.draw(st.sampled_from(["push", "push", "take", "finish"]))
        if action == "push":
            flow = Flow(data.draw(st.sampled_from([0, 0, 10])), f"t{data.draw(st.integers(0, tenants - 1))}")
            rid = f"q{step}"
            holders[rid], works[rid], patient[rid] = data.draw(HOLDERS), data.draw(WORK), data.draw(st.booleans())
            queued[rid] = flow
            waiting_before = {other: queue.counters[other] for other, _ in queue.depths()
                              if other.priority == flow.priority}
            assert queue.push(waiting(rid, flow, step))
            if flow not in waiting_before and waiting_before:  # waiting afresh: no credit for the time idle
                assert queue.counters[flow] >= min(waiting_before.values())
        elif action == "finish" and in_flight:
            queue.finished(in_flight.pop(data.draw(st.integers(0, len(in_flight) - 1))))
        elif action == "take" and len(queue):
            rooms = tuple(data.draw(st.lists(st.sampled_from(REPLICAS), min_size=1, max_size=3, unique=True)))

            def kind_of(rid: str, rooms: tuple[str, ...] = rooms) -> int | None:
                return kind(holders[rid], rooms, patient[rid])

            looked_at = Counter[Flow]()  # a flow's first LOOKAHEAD requests are looked at
            could_go = set()
            for rid, flow in queued.items():
                looked_at[flow] += 1
                if looked_at[flow] <= LOOKAHEAD and kind_of(rid) is not None:
                    could_go.add(flow.priority)
            choice = queue.choose(lambda _, rooms=rooms: rooms, lambda item, rooms: kind_of(item.request.request_id))
            if not could_go:  # every request is held back for its holder
                assert choice is None
                continue
            if choice is None and turn_waits:  # the least served flow's turn waits for its holder
                queue.turn_waits = False  # without the knob, that flow's held request would go now, elsewhere
                forced = queue.choose(lambda _, rooms=rooms: rooms,
                                      lambda item, rooms: kind_of(item.request.request_id))
                queue.turn_waits = True
                assert forced is not None and forced.kind == FAIR
                assert kind_of(forced.waiting.request.request_id) is None  # it was held back for its holder
                continue
            top = max(could_go)
            band = {flow: queue.counters[flow] for flow, _ in queue.depths() if flow.priority == top}
            assert choice is not None and choice.waiting.flow.priority == top  # strict priority
            flow = choice.waiting.flow
            assert choice.least == min(band.values())
            assert band[flow] == choice.counter <= choice.least + deficit  # the deficit bound
            work = works[choice.waiting.request.request_id]
            largest = max(largest, work)
            queue.take(choice.waiting, work)
            del queued[choice.waiting.request.request_id]
            in_flight.append(flow)
            still = [counter for other, counter in band.items() if other != flow and other in dict(queue.depths())]
            assert all(queue.counters[flow] - counter <= deficit + largest for counter in still)


@settings(max_examples=100)
@given(st.data(), st.floats(min_value=0, max_value=1000), st.integers(min_value=2, max_value=6),
       st.integers(min_value=1, max_value=50))
def test_a_waiting_request_is_served_within_the_bound_however_busy_the_others(
        data: st.DataObject, deficit: float, flows: int, least_work: int) -> None:
    queue = FairQueue(band_size=1000, locality_deficit=deficit)
    noisy = [Flow(0, f"noisy{index}") for index in range(flows - 1)]
    sequence = 0

    def send(flow: Flow) -> None:
        nonlocal sequence
        sequence += 1
        assert queue.push(waiting(f"{flow.tenant}-{sequence}", flow, sequence))

    holders = {}
    for flow in noisy:
        for _ in range(3):
            send(flow)
    for _ in range(data.draw(st.integers(0, 20))):  # some history first
        choice = queue.choose(lambda _: ("r0",), lambda _, rooms: NEW)
        assert choice is not None
        queue.take(choice.waiting, data.draw(st.integers(least_work, 10 * least_work)))
        send(choice.waiting.flow)
    queue.push(waiting("quiet", Flow(0, "quiet"), sequence + 1))
    bound = (flows - 1) * (math.floor(deficit / least_work) + 1)
    for taken in range(bound + 1):
        choice = queue.choose(lambda _: ("r0",), lambda item, rooms: kind(
            holders.setdefault(item.request.request_id, data.draw(HOLDERS)), rooms))
        assert choice is not None
        if choice.waiting.request.request_id == "quiet":
            assert taken <= bound
            return
        queue.take(choice.waiting, data.draw(st.integers(least_work, 10 * least_work)))
        send(choice.waiting.flow)  # the noisy flows never stop sending
    raise AssertionError(f"the quiet request waited more than {bound} dispatches")


class FlowControlMachine(RuleBasedStateMachine):
    """Arrivals, ends, cancellations and the clock in any order, on a real Router."""

    @initialize(reserved=st.integers(min_value=0, max_value=1), deficit=st.sampled_from([0.0, 500.0, 5000.0]))
    def start(self, reserved: int, deficit: float) -> None:
        self.slots = 2
        self.settings = flow_settings(reserved_slots=reserved, locality_deficit=deficit, band_size=5, ttl_seconds=3.0)
        self.control = FlowControl(Router(routing(slots=self.slots), REPLICAS), self.settings)
        self.now = 0.0
        self.sequence = 0
        self.in_flight: dict[str, Flow] = {}
        self.waiting: dict[str, Waiting] = {}
        self.gone: set[str] = set()  # cancelled or expired: never dispatched after

    def _dispatch(self) -> None:
        for sent in self.control.dispatch(self.now):
            rid = sent.waiting.request.request_id
            assert rid in self.waiting and rid not in self.gone
            del self.waiting[rid]
            assert sent.ticket is not None  # the fleet never shrinks here
            self.in_flight[rid] = sent.waiting.flow

    @rule(tenant=st.sampled_from(["a", "b", "c"]), priority=st.sampled_from([0, 10]),
          conversation=st.integers(0, 5), prompt=st.integers(1, 2000), avoid=st.sampled_from([(), ("r0",)]))
    def arrive(self, tenant: str, priority: int, conversation: int, prompt: int, avoid: tuple[str, ...]) -> None:
        self.sequence += 1
        rid = f"req{self.sequence}"
        flow = Flow(priority, tenant)
        band_before = sum(1 for item in self.waiting.values() if item.flow.priority == priority)
        admitted = self.control.admit(RouteRequest(rid, f"conv{conversation}", prompt, 16), flow, avoid, self.now)
        if isinstance(admitted, Routed):
            assert not self.waiting  # at once only when nothing waits
            assert admitted.ticket.decision.replica not in avoid
            self.in_flight[rid] = flow
        elif isinstance(admitted, Queued):
            self.waiting[rid] = admitted.waiting
        else:
            assert admitted == Refused("queue_full") and band_before == self.settings.band_size
        self._dispatch()

    @precondition(lambda self: self.in_flight)
    @rule(pick=st.integers(min_value=0), reported=st.none() | st.tuples(st.integers(0, 2000), st.integers(0, 16)))
    def end(self, pick: int, reported: tuple[int, int] | None) -> None:
        rid = sorted(self.in_flight)[pick % len(self.in_flight)]
        del self.in_flight[rid]
        assert self.control.router.complete(rid) is not None
        self.control.released(rid)
        self.control.settle(rid, reported)
        self._dispatch()

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(min_value=0))
    def cancel(self, pick: int) -> None:
        rid = sorted(self.waiting)[pick % len(self.waiting)]
        counters = dict(self.control.queue.counters)
        assert self.control.cancel(rid)
        del self.waiting[rid]
        self.gone.add(rid)
        assert all(self.control.queue.counters.get(flow) == counter for flow, counter in counters.items()
                   if flow in self.control.queue.counters)  # nothing charged to anyone
        self._dispatch()

    @rule(seconds=st.floats(min_value=0.1, max_value=2.0))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        for expired in self.control.expire(self.now):
            rid = expired.request.request_id
            assert expired.deadline <= self.now and self.waiting.pop(rid) == expired
            self.gone.add(rid)
        assert all(item.deadline > self.now for item in self.waiting.values())
        self._dispatch()  # as the service's timer does: a request may have stopped waiting for its holder

    @invariant()
    def slots_are_never_overfilled_and_the_ledger_agrees(self) -> None:
        if not hasattr(self, "control"):
            return
        ledger = self.control.router.ledger
        assert ledger.total_requests() == len(self.in_flight)
        assert all(ledger.requests(name) <= self.slots for name in REPLICAS)
        sizes = Counter(item.flow.priority for item in self.waiting.values())
        assert all(size <= self.settings.band_size for size in sizes.values())

    @invariant()
    def nothing_waits_that_a_replica_could_take(self) -> None:
        if not hasattr(self, "control") or not self.waiting:
            return
        loads = self.control.router.ledger.loads("requests")
        demand = Counter(self.in_flight.values()) + Counter(item.flow for item in self.waiting.values())
        busiest = max(demand.values(), default=0)
        router = self.control.router
        for item in self.waiting.values():
            limit = self.slots if demand[item.flow] < busiest else self.slots - self.settings.reserved_slots
            if all(loads[name] >= limit for name in REPLICAS if name not in item.avoid):
                continue
            # a replica it may take has room: it must be waiting for its full cache holder, within its patience
            placement = router.memory.get(item.request.key)
            assert placement is not None and placement.replica not in item.avoid, (item, dict(loads))
            assert loads[placement.replica] >= limit, (item, dict(loads))
            speed = router.speeds.speed(placement.replica)
            patience = min(speed.overhead_s + placement.prompt_tokens * speed.prefill_s_per_token,
                           self.settings.ttl_seconds / 2)
            assert self.now < item.arrived + patience, (item, dict(loads), self.now)

    def teardown(self) -> None:
        if not hasattr(self, "control"):
            return
        for rid in list(self.waiting):
            assert self.control.cancel(rid)
        for rid in list(self.in_flight):
            self.control.router.complete(rid)
            self.control.released(rid)
            self.control.settle(rid, None)
        queue = self.control.queue
        assert not len(queue) and not queue.counters and not queue.in_flight and not self.control._charges
        assert self.control.router.ledger.total_requests() == 0 and self.control.dispatch(self.now) == []


TestFlowControl = FlowControlMachine.TestCase
TestFlowControl.settings = settings(max_examples=200, stateful_step_count=40)
