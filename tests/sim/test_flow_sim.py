"""Flow control in the simulator (extproc/sim/flow.py): the core's FlowControl decides, its
waits reach the requests as the service's decision traces carry them, its order holds in the
simulated fleet, and tenants come from the noisy-neighbour mix and a trace's split."""

from __future__ import annotations

from collections import Counter

import pytest

from extproc.routing.flow_control import FlowControl
from extproc.routing.settings import with_knobs
from extproc.sim.costmodel import load_cost_model
from extproc.sim.flow_runs import flow_spec, parse_variant, replica_room, tenant_figures
from extproc.sim.request import Request
from extproc.sim.runs import load_sim_config, parse_policy, run_once
from extproc.sim.workload import MIXES, mixed_workload, tenant_of

GPU = "llama31-8b-rtx3090-llamacpp"


def noisy_neighbour(variant: str, replicas: int = 2) -> list[Request]:
    """One seed of the noisy-neighbour mix on ``replicas`` llama.cpp GPU replicas of 4 slots."""
    config = load_sim_config()
    assert config.flow is not None
    cost = load_cost_model(GPU)
    fleet = config.fleet(replicas, cost)
    spec = flow_spec(parse_variant(variant, config.flow), config.flow)
    routing = parse_policy("llm-aware", with_knobs(config.routing, {"replicas.slots": replica_room(fleet, cost)}))
    return run_once(mixed_workload(MIXES["noisy-neighbour"], 1), routing, cost, fleet, flow=spec).requests


def test_with_flow_on_every_request_carries_the_core_s_wait_and_some_waited_in_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dispatches = Counter[str]()
    dispatch = FlowControl.dispatch

    def counted(self: FlowControl, now: float) -> list:  # type: ignore[type-arg]
        dispatches["calls"] += 1
        return dispatch(self, now)

    monkeypatch.setattr(FlowControl, "dispatch", counted)
    requests = noisy_neighbour("ours")
    answered = [request for request in requests if request.status == 200]
    assert answered and dispatches["calls"] > 0
    assert all(request.wait is not None and request.wait.flow.tenant == request.tenant for request in answered)
    kinds = Counter(request.wait.kind for request in answered if request.wait is not None)
    assert kinds["at_once"] and kinds["local"] + kinds["new"] + kinds["fair"]  # some waited, then left
    waited = [request for request in answered if request.wait is not None and request.wait.kind != "at_once"]
    assert all(request.wait is not None and request.wait.as_dict()["waited_ms"] >= 0 for request in waited)


def test_without_flow_control_no_request_goes_through_the_queue() -> None:
    requests = noisy_neighbour("none")
    assert requests and all(request.wait is None for request in requests)


def test_fifo_in_the_simulated_fleet_sends_waiting_requests_in_arrival_order() -> None:
    requests = noisy_neighbour("fifo")
    waited = [request for request in requests if request.wait is not None and request.wait.kind != "at_once"]
    assert len(waited) > 10
    by_departure = sorted(waited, key=lambda request: (request.arrived_at + request.wait.waited, request.arrived_at))
    assert [request.arrived_at for request in by_departure] == sorted(request.arrived_at for request in waited)


def test_flow_control_s_slots_are_the_replicas_so_no_request_queues_inside_a_replica() -> None:
    requests = noisy_neighbour("fifo")
    for request in requests:
        if request.status == 200 and request.wait is not None:
            # the router's queue replaces the replica's: a request starts on a slot when it is routed
            assert request.started_at == pytest.approx(request.arrived_at + request.wait.waited)


def test_the_quiet_tenant_is_faster_with_our_queue_than_without_any() -> None:
    config = load_sim_config()
    assert config.flow is not None
    without, ours = (tenant_figures(noisy_neighbour(variant), config.flow) for variant in ("none", "ours"))
    assert ours["tenants"]["quiet"]["p95_ttft_s"] < without["tenants"]["quiet"]["p95_ttft_s"] / 2


def test_the_noisy_neighbour_mix_keeps_each_tenant_s_conversations_apart() -> None:
    quiet, noisy = mixed_workload(MIXES["noisy-neighbour"], 3)
    assert {first.tenant for first in quiet.conversations} == {"quiet"}
    assert {first.tenant for first in noisy.conversations} == {"noisy"}
    names = [first.conversation for loop in (quiet, noisy) for first in loop.conversations]
    assert len(names) == len(set(names))  # the two profiles make the same ids: each tenant prefixes its own


def test_a_trace_is_split_into_tenants_by_hash_in_proportion_to_their_weights() -> None:
    tenants = (("big", 6), ("mid", 3), ("small", 1))
    split = Counter(tenant_of(f"m{number:05d}", tenants) for number in range(6000))
    assert abs(split["big"] / 6000 - 0.6) < 0.03 and abs(split["small"] / 6000 - 0.1) < 0.02
    assert tenant_of("m00042", tenants) == tenant_of("m00042", tenants)


def test_a_variant_s_knobs_switch_each_part_and_a_wrong_one_is_named() -> None:
    config = load_sim_config()
    assert config.flow is not None
    ours = parse_variant("ours:patience=false,reserved_slots=0", config.flow)
    assert (ours.order, ours.patience, ours.reserved_slots) == ("vtc-local", False, 0)
    assert parse_variant("vtc", config.flow).reserved_slots == 0
    stretched = parse_variant("ours:patience_scale=4,turn_waits=true", config.flow)
    assert (stretched.patience_scale, stretched.turn_waits, stretched.patience) == (4.0, True, True)
    assert (ours.patience_scale, ours.turn_waits) == (1.0, False)
    with pytest.raises(ValueError, match="knob"):
        parse_variant("fifo:speed=2", config.flow)
    with pytest.raises(ValueError, match="unknown variant"):
        parse_variant("lifo", config.flow)
