"""The Admin API and the metrics collector read one live state (Gateway.replica_states): the
same replicas, addresses, health and load in flight, whichever asks; Admin's settings
changes are checked like the settings file; the histograms count what they are given."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.routing.speeds import AnswerTimings
from extproc.service import admin_pb2
from extproc.service.admin import AdminService
from extproc.service.bodies import Timings
from extproc.service.metrics import DECISION_SECONDS, Histogram, Metrics
from tests.service.test_gateway_lifecycle import ENDPOINTS, decide, make_gateway


class AbortingContext:
    """grpc.aio's context as far as SetRouting uses it: abort raises, as grpc.aio's does."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise grpc.RpcError(details)


def gauges(metrics: Metrics) -> dict[str, dict[str, float]]:
    """{gauge name: {replica: value}} of the live-state families (per replica) in a scrape."""
    text = generate_latest(metrics.registry).decode()
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge":
            for sample in (sample for sample in family.samples if "replica" in sample.labels):
                found.setdefault(sample.name, {})[sample.labels["replica"]] = sample.value
    return found


def test_admin_state_and_the_scrape_show_the_same_replicas_load_and_health() -> None:
    gateway = make_gateway()
    gateway.metrics.watch(gateway.replica_states)
    request_id, endpoint = decide(gateway, "envoy-1")
    pick = gateway.requests.pending[request_id].decision.replica
    other = next(name for name in ENDPOINTS if name != pick)
    gateway.mark_unhealthy(other)

    state = AdminService(gateway).state()
    by_name = {replica.name: replica for replica in state.replicas}
    assert set(by_name) == set(ENDPOINTS)
    assert by_name[pick].address == endpoint == ENDPOINTS[pick]
    assert by_name[pick].in_flight_requests == 1 and by_name[pick].in_flight_tokens > 0
    assert not by_name[other].healthy and by_name[pick].healthy
    assert state.in_flight_requests == 1 and state.decisions == 1

    scraped = gauges(gateway.metrics)
    for replica in state.replicas:
        assert scraped["llm_ring_in_flight_requests"][replica.name] == replica.in_flight_requests
        assert scraped["llm_ring_in_flight_tokens"][replica.name] == replica.in_flight_tokens
        assert scraped["llm_ring_replica_healthy"][replica.name] == (1 if replica.healthy else 0)

    gateway.requests.access_logged(request_id, 200, endpoint, cut_off=False, timings=None)
    assert all(replica.in_flight_requests == 0 for replica in AdminService(gateway).state().replicas)
    assert set(gauges(gateway.metrics)["llm_ring_in_flight_requests"].values()) == {0}


def test_an_answers_timings_teach_its_replicas_speed_shown_in_admin_state_and_scrape() -> None:
    gateway = make_gateway()
    gateway.metrics.watch(gateway.replica_states, lambda: gateway.router.speeds.speeds())
    request_id, endpoint = decide(gateway, "envoy-1")
    pick = gateway.requests.pending[request_id].decision.replica
    prior = AdminService(gateway).state().replicas[0].prefill_tokens_per_s
    gateway.requests.access_logged(request_id, 200, endpoint, cut_off=False,
                          timings=Timings(cache_n=0, prompt_n=2000, prompt_ms=1000.0, predicted_n=8, predicted_ms=80.0))
    by_name = {replica.name: replica for replica in AdminService(gateway).state().replicas}
    assert by_name[pick].answers_learnt == 1  # until its answers outweigh the prior: the fleet's speed
    assert by_name[pick].prefill_tokens_per_s == prior
    speeds = gateway.router.speeds
    for _ in range(speeds.trust_answers - 1):
        speeds.learn(pick, AnswerTimings(prompt_n=2000, prompt_ms=1000.0, predicted_n=8, predicted_ms=80.0, cache_n=0))
    by_name = {replica.name: replica for replica in AdminService(gateway).state().replicas}
    assert by_name[pick].prefill_tokens_per_s > prior  # 2,000 tokens a second beats the prior's 167
    # the others, unanswered, are taken to be as fast as the fleet's answered replicas
    assert all(replica.answers_learnt == 0 and replica.prefill_tokens_per_s == by_name[pick].prefill_tokens_per_s
               for name, replica in by_name.items() if name != pick)
    scraped = gauges(gateway.metrics)
    for name, replica in by_name.items():
        shown = {family: scraped[f"llm_ring_replica_{family}"][name] for family in (
            "prefill_tokens_per_second", "decode_tokens_per_second", "request_overhead_seconds")}
        assert shown == pytest.approx({"prefill_tokens_per_second": replica.prefill_tokens_per_s,
                                       "decode_tokens_per_second": replica.decode_tokens_per_s,
                                       "request_overhead_seconds": replica.request_overhead_ms / 1000})


def test_metrics_without_a_live_state_show_no_replicas() -> None:
    assert gauges(Metrics()) == {}


def set_routing(admin: AdminService, knobs: dict[str, str], context: AbortingContext | None = None) -> admin_pb2.State:
    request = admin_pb2.SetRoutingRequest(routing=admin_pb2.RoutingSettings(knobs=knobs))
    return asyncio.run(admin.SetRouting(request, context or AbortingContext()))  # type: ignore[arg-type]


def test_set_routing_changes_only_the_knobs_given_and_refuses_bad_values_by_name() -> None:
    gateway = make_gateway()
    admin = AdminService(gateway)
    before = gateway.router.settings
    answer = set_routing(admin, {"epsilon": "0.5"})
    assert answer.routing.knobs["epsilon"] == "0.5" and gateway.router.settings.knobs()["epsilon"] == 0.5
    assert gateway.router.settings.policy == before.policy and answer.routing.knobs["policy"] == f'"{before.policy}"'
    assert gateway.router.settings.hash_seed == before.hash_seed  # a shared key not given keeps its value

    for knobs, named in [({"policy": "best"}, "policy"), ({"epsilon": "-1"}, "epsilon"),
                         ({"epsilon": "many"}, "epsilon"), ({"epsilonn": "0.5"}, "epsilonn")]:
        context = AbortingContext()
        with pytest.raises(grpc.RpcError):
            set_routing(admin, knobs, context)
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and named in context.details
    assert gateway.router.settings.knobs()["epsilon"] == 0.5  # nothing changed


@pytest.mark.parametrize(("knob", "place"), [("replica_slots", "routing.replicas.slots"),
                                             ("prefix_capacity_tokens", "routing.replicas.cache_tokens")])
def test_set_routing_refuses_a_moved_knob_naming_its_new_place(knob: str, place: str) -> None:
    gateway = make_gateway()
    context = AbortingContext()
    with pytest.raises(grpc.RpcError):
        set_routing(AdminService(gateway), {"policy": '"llm-aware"', knob: "4"}, context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and f"{knob}: moved to {place}" in context.details


def test_set_routing_sets_any_registered_policys_own_parameters() -> None:
    """A peer policy's parameter, which no field of the Admin message names, is set by its key."""
    gateway = make_gateway()
    answer = set_routing(AdminService(gateway), {"policy": "prefix-affinity", "prefix_weight": "5.0"})
    assert gateway.router.settings.policy == "prefix-affinity"
    assert gateway.router.settings.params["prefix-affinity"].prefix_weight == 5.0
    assert answer.routing.knobs["prefix_weight"] == "5.0" and "epsilon" not in answer.routing.knobs


def test_reset_forgets_the_load_in_flight() -> None:
    gateway = make_gateway()
    decide(gateway, "envoy-1")
    state = asyncio.run(AdminService(gateway).Reset(admin_pb2.ResetRequest(), None))  # type: ignore[arg-type]
    assert state.in_flight_requests == 0


@given(st.lists(st.sampled_from([*DECISION_SECONDS, 0.0, 1e-6, 1.0]) | st.floats(0, 1), max_size=50))
def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it(values: list[float]) -> None:
    histogram = Histogram(DECISION_SECONDS)
    for value in values:
        histogram.observe(value)
    family: Any = histogram.family("h", "test")
    cumulative = {sample.labels["le"]: sample.value for sample in family.samples if sample.name == "h_bucket"}
    for bound in DECISION_SECONDS:
        assert cumulative[str(bound)] == sum(1 for value in values if value <= bound)
    assert cumulative["+Inf"] == len(values)
    assert math.isclose(histogram.sum, sum(values), abs_tol=1e-9)
