"""Flow control's rules, one at a time, on a real Router (extproc/routing/flow_control.py)."""

from __future__ import annotations

import pytest

from extproc.routing import Router, RouteRequest
from extproc.routing.fairness import SWEEP_TENANTS, FairnessWindow
from extproc.routing.flow_control import NO_REPLICA, QUEUE_FULL, FlowControl, Queued, Refused, Routed
from extproc.routing.flows import Flow, flow_of
from extproc.routing.queue import FAIR, NEW, FairQueue, Waiting
from extproc.routing.replica_facts import ReplicaFacts
from tests.routing.conftest import routing
from tests.routing.flow_support import flow_settings

REPLICAS = ["llm-0", "llm-1"]
LOW, HIGH = Flow(0, "a"), Flow(10, "a")
FILLER = Flow(0, "filler")


def control(slots: int = 2, **changes: object) -> FlowControl:
    """Flow control over two replicas of ``slots`` slots (routing.replicas.slots)."""
    return FlowControl(Router(routing(slots=slots), REPLICAS), flow_settings(**changes))


def request(rid: str, conversation: str | None = None, prompt: int = 100, max_tokens: int = 10) -> RouteRequest:
    return RouteRequest(rid, conversation or f"conv-{rid}", prompt, max_tokens)


def fill(flow_control: FlowControl, flow: Flow = FILLER, count: int = 4) -> list[str]:
    """Fill every slot of the fleet (2 replicas x 2 slots) with ``flow``'s requests."""
    ids = [f"fill-{flow.tenant}-{index}" for index in range(count)]
    for rid in ids:
        assert isinstance(flow_control.admit(request(rid), flow, (), 0.0), Routed)
    return ids


def release(flow_control: FlowControl, rid: str) -> None:
    assert flow_control.router.complete(rid) is not None
    flow_control.released(rid)
    flow_control.settle(rid, None)


def test_with_room_and_nothing_waiting_a_request_is_routed_at_once_as_without_flow_control() -> None:
    flow_control, plain = control(), Router(routing(), REPLICAS)
    for index in range(3):
        admitted = flow_control.admit(request(str(index)), LOW, (), 0.0)
        assert isinstance(admitted, Routed)
        assert admitted.ticket.decision == plain.route(request(str(index))).decision  # type: ignore[union-attr]


def test_each_replica_s_room_is_its_slots_as_the_router_answers_them() -> None:
    class OneSlotOnLlm0(Router):  # a replica whose own facts differ from the fleet's
        def facts(self, replica: str) -> ReplicaFacts:
            facts = super().facts(replica)
            return facts.model_copy(update={"slots": 1}) if replica == "llm-0" else facts

    flow_control = FlowControl(OneSlotOnLlm0(routing(slots=2), REPLICAS), flow_settings())
    fill(flow_control, count=3)  # llm-0 one, llm-1 two
    assert flow_control.router.ledger.loads("requests") == {"llm-0": 1, "llm-1": 2}
    assert isinstance(flow_control.admit(request("late"), LOW, (), 1.0), Queued)


def test_a_full_fleet_holds_the_request_until_a_slot_frees_then_it_goes_there() -> None:
    flow_control = control()
    ids = fill(flow_control)
    queued = flow_control.admit(request("late"), LOW, (), 1.0)
    assert isinstance(queued, Queued) and flow_control.dispatch(1.0) == []
    freed = flow_control.router.complete(ids[0])
    assert freed is not None
    flow_control.released(ids[0])
    [sent] = flow_control.dispatch(3.5)
    assert sent.ticket is not None and sent.ticket.decision.replica == freed.replica
    assert sent.wait.waited == pytest.approx(2.5) and sent.waiting.request.request_id == "late"


def test_a_higher_band_goes_first_whatever_the_order_of_arrival() -> None:
    flow_control = control()
    ids = fill(flow_control)
    for index in range(3):
        flow_control.admit(request(f"low-{index}"), LOW, (), 1.0)
    flow_control.admit(request("high"), HIGH, (), 2.0)
    release(flow_control, ids[0])
    [sent] = flow_control.dispatch(2.0)
    assert sent.waiting.request.request_id == "high"


def test_within_a_band_the_tenants_share_in_tokens_of_work_not_in_requests() -> None:
    flow_control = control(locality_deficit=0.0)
    ids = fill(flow_control)
    for index in range(6):  # a heavy tenant with long prompts and a light one, both waiting
        flow_control.admit(request(f"heavy-{index}", prompt=1000), Flow(0, "heavy"), (), 1.0)
        flow_control.admit(request(f"light-{index}", prompt=100), Flow(0, "light"), (), 1.0)
    order = []
    for rid in ids:
        release(flow_control, rid)
        order += [sent.waiting.flow.tenant for sent in flow_control.dispatch(2.0)]
    # equal counters: the first come goes first; then 1,020 tokens of work against 120 a request
    assert order == ["heavy", "light", "light", "light"]


def test_a_request_whose_cache_holder_has_room_goes_ahead_within_the_deficit_and_not_beyond() -> None:
    for deficit, expected in ((10_000.0, "local"), (0.0, "new")):
        flow_control = control(locality_deficit=deficit)
        router = flow_control.router
        ids = fill(flow_control)
        # the filler, served 4 times already, is ahead of the quiet tenant by a request's work
        flow_control.admit(request("first-come", prompt=50), Flow(0, "quiet"), (), 1.0)
        flow_control.admit(request("follow-up", f"conv-{ids[0]}", prompt=150), Flow(0, "filler"), (), 2.0)
        holder = router.complete(ids[0])  # the follow-up's cache is where this slot frees
        assert holder is not None
        flow_control.released(ids[0])
        [sent] = flow_control.dispatch(2.0)
        assert sent.wait.kind == expected
        assert sent.waiting.request.request_id == ("follow-up" if expected == "local" else "first-come")
        if expected == "local":
            assert sent.ticket is not None and sent.ticket.decision.replica == holder.replica
            assert sent.wait.counter <= sent.wait.least + deficit


def test_a_full_band_refuses_and_a_fleet_without_an_eligible_replica_refuses() -> None:
    flow_control = control(band_size=2)
    fill(flow_control)
    assert isinstance(flow_control.admit(request("w1"), LOW, (), 0.0), Queued)
    assert isinstance(flow_control.admit(request("w2"), LOW, (), 0.0), Queued)
    assert flow_control.admit(request("w3"), LOW, (), 0.0) == Refused(QUEUE_FULL)
    assert isinstance(flow_control.admit(request("w4"), HIGH, (), 0.0), Queued)  # another band, its own size
    assert flow_control.admit(request("w5"), LOW, REPLICAS, 0.0) == Refused(NO_REPLICA)


def test_expired_and_cancelled_requests_leave_the_queue_with_nothing_charged() -> None:
    flow_control = control(ttl_seconds=5.0)
    ids = fill(flow_control, Flow(0, "busy"))
    before = dict(flow_control.queue.counters)
    flow_control.admit(request("old"), LOW, (), 0.0)
    flow_control.admit(request("gone"), Flow(0, "b"), (), 1.0)
    flow_control.admit(request("young"), LOW, (), 4.0)
    assert flow_control.cancel("gone") and not flow_control.cancel("gone")
    assert [waiting.request.request_id for waiting in flow_control.expire(5.5)] == ["old"]
    assert flow_control.queue.next_deadline() == 9.0
    assert [waiting.request.request_id for waiting in flow_control.expire(9.0)] == ["young"]
    assert flow_control.queue.counters == before  # only the routed flow is known, its counter untouched
    for rid in ids:
        release(flow_control, rid)
    assert not flow_control.queue.counters and not flow_control.queue.in_flight
    assert flow_control.router.ledger.total_requests() == 0


def test_reserved_slots_stay_free_under_a_flood_and_a_quiet_tenant_takes_them_at_once() -> None:
    flow_control = control(slots=3, reserved_slots=1)
    flood = Flow(0, "flood")
    admitted = [flow_control.admit(request(f"f{index}"), flood, (), 0.0) for index in range(6)]
    assert [isinstance(item, Routed) for item in admitted] == [True] * 4 + [False] * 2  # 2 open slots a replica
    assert flow_control.dispatch(0.0) == []
    quiet = flow_control.admit(request("q"), Flow(0, "quiet"), (), 0.1)
    assert isinstance(quiet, Queued)  # the flood waits: a newcomer queues behind it ...
    [sent] = flow_control.dispatch(0.1)  # ... but holding less than the flood it may take a reserved slot
    assert sent.waiting.request.request_id == "q" and sent.ticket is not None


def test_a_flood_held_out_of_the_reserved_slots_is_still_the_busiest_by_what_waits() -> None:
    """One open slot a replica: the flood runs 2 and has 4 waiting; a quiet tenant with as many
    in flight (2) is still the smaller flow, so its third request takes a reserved slot."""
    flow_control = control(slots=4, reserved_slots=3)
    flood, quiet = Flow(0, "flood"), Flow(0, "quiet")
    admitted = [flow_control.admit(request(f"f{index}"), flood, (), 0.0) for index in range(6)]
    assert [isinstance(item, Routed) for item in admitted] == [True] * 2 + [False] * 4
    for index in range(3):
        flow_control.admit(request(f"q{index}"), quiet, (), 0.1)
        sent = flow_control.dispatch(0.1)
        assert [item.waiting.request.request_id for item in sent] == [f"q{index}"]
    assert flow_control.queue.demand(quiet) == 3 and flow_control.queue.demand(flood) == 6


def test_settle_corrects_the_estimate_with_what_the_replica_reported() -> None:
    flow_control = control(input_weight=1.0, output_weight=2.0)
    flow = Flow(0, "t")
    admitted = flow_control.admit(request("r", prompt=100, max_tokens=50), flow, (), 0.0)
    assert isinstance(admitted, Routed)
    flow_control.admit(request("keep", prompt=1, max_tokens=1), flow, (), 0.0)  # keeps the flow known
    charged = flow_control.queue.counters[flow]
    assert charged == 100 + 2 * 50 + 1 + 2
    flow_control.settle("r", (100, 5))  # 5 of the 50 tokens asked for were generated
    assert flow_control.queue.counters[flow] == charged - 2 * 45


def test_flows_come_from_the_headers_and_an_anonymous_request_is_capped() -> None:
    settings = flow_settings(anonymous_max_priority=0)
    assert flow_of(settings, "acme", "interactive") == Flow(10, "acme")
    assert flow_of(settings, "", "interactive") == Flow(0, "default")  # no tenant: capped
    assert flow_of(settings, "acme", "unknown") == Flow(0, "acme")
    assert flow_of(settings, "", "batch") == Flow(-10, "default")


def test_jain_counts_the_tenants_that_waited_over_the_window() -> None:
    window = FairnessWindow(window_s=10.0)
    assert window.jain(0.0) == 1.0  # nothing contended
    window.waited(0.0, "a")
    window.waited(0.0, "b")
    window.served(1.0, "a", 300.0)
    window.served(1.0, "b", 100.0)
    window.served(1.0, "c", 10_000.0)  # never waited: it got what it asked, no sign of unfairness
    assert window.jain(2.0) == pytest.approx(400**2 / (2 * (300**2 + 100**2)))
    window.served(5.0, "b", 200.0)
    assert window.jain(6.0) == pytest.approx(1.0)
    assert window.jain(11.5) == 1.0  # the first shares and both waits are out of the window
    window.waited(11.5, "a")
    window.waited(11.5, "b")
    assert window.jain(11.6) == pytest.approx(0.5)  # b's later share alone: a waited and got nothing


def test_the_fairness_window_stays_bounded_when_nothing_reads_its_index() -> None:
    """Nothing scrapes the metrics: a day of requests and of one-off tenants keeps what the
    window holds, not what it ever saw."""
    window = FairnessWindow(window_s=10.0)
    for second in range(86_400):
        window.waited(float(second), f"tenant-{second}")
        window.served(float(second), f"tenant-{second}", 1.0)
    assert len(window._served) <= 11 and len(window._totals) <= 11
    assert len(window._waited) <= 2 * SWEEP_TENANTS
    assert window.jain(86_400.0) == pytest.approx(1.0)


def test_a_request_waits_for_its_full_cache_holder_as_long_as_its_cache_takes_to_compute_again() -> None:
    flow_control = control()
    router = flow_control.router
    ids = fill(flow_control)
    holder = router.complete(ids[0])  # its conversation is cached there (100 tokens); that slot frees
    assert holder is not None
    flow_control.released(ids[0])
    assert isinstance(flow_control.admit(request("blocker"), Flow(0, "b"), (), 0.5), Routed)  # takes it
    elsewhere = next(rid for rid in ids[1:] if router._in_flight[rid].decision.replica != holder.replica)
    release(flow_control, elsewhere)  # a slot frees on the other replica
    follow_up = flow_control.admit(request("follow-up", f"conv-{ids[0]}", prompt=150), FILLER, (), 1.0)
    assert isinstance(follow_up, Queued)  # nothing waits, a replica has room, but not its holder
    placement = router.memory.get(follow_up.waiting.request.key)
    assert placement is not None and placement.replica == holder.replica
    patience = flow_control.patience(placement)
    assert patience == pytest.approx(0.019 + 100 / 167)  # the prior's overhead + 100 tokens at 167 tokens/s
    assert flow_control.dispatch(1.0 + patience / 2) == [] and flow_control.wake == pytest.approx(1.0 + patience)
    [sent] = flow_control.dispatch(1.0 + patience)
    assert sent.wait.kind == "fair" and sent.ticket is not None and sent.ticket.decision.replica != holder.replica


def test_patience_scale_stretches_the_wait_for_the_holder_up_to_half_the_ttl() -> None:
    router = Router(routing(slots=2), REPLICAS)
    plain, stretched = FlowControl(router, flow_settings()), FlowControl(router, flow_settings(), patience_scale=3.0)
    [first, *_] = fill(plain)
    assert router.complete(first) is not None  # its conversation is cached there (100 tokens)
    placement = router.memory.get(router.keyed(request("x", f"conv-{first}")).key)
    assert placement is not None
    assert stretched.patience(placement) == pytest.approx(3 * plain.patience(placement))
    capped = FlowControl(router, flow_settings(), patience_scale=1e6)
    assert capped.patience(placement) == pytest.approx(flow_settings().ttl_seconds / 2)


def test_with_turn_waits_the_least_served_flow_s_turn_waits_for_its_holder_instead_of_going_away() -> None:
    held, ahead = Flow(0, "held"), Flow(0, "ahead")
    for turn_waits in (False, True):
        queue = FairQueue(band_size=10, locality_deficit=100.0, turn_waits=turn_waits)
        queue.push(Waiting(request("h"), held, frozenset(), 0.0, 60.0))
        queue.push(Waiting(request("a"), ahead, frozenset(), 0.0, 60.0))
        queue.counters[ahead] = 1_000.0  # past the deficit over the held flow

        def kind(waiting: Waiting, rooms: tuple[str, ...]) -> int | None:
            return None if waiting.flow == held else NEW  # the held flow's holder is full, within its patience

        choice = queue.choose(lambda _: ("llm-1",), kind)
        if turn_waits:
            assert choice is None  # nothing leaves: the others are past the deficit, the held flow waits
        else:
            assert choice is not None and choice.waiting.flow == held and choice.kind == FAIR
