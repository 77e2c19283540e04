"""replicas_from_slices: which EndpointSlice endpoints become replicas, under which names; which
are leaving (terminating, still serving)."""

from __future__ import annotations

import json
from typing import Any

from fake_apiserver import Endpoint, endpoint_slice
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client

from extproc.discovery import Snapshot
from extproc.discovery.kubernetes import replicas_from_slices, snapshot_from_slices

_DESERIALIZER = client.ApiClient()


def model(raw: dict[str, Any]) -> Any:
    """The client model the watch hands over, built from the JSON the API server sends."""
    return _DESERIALIZER.deserialize(json.dumps(raw), "V1EndpointSlice", "application/json")


def replicas(*raws: dict[str, Any], port_name: str = "http") -> dict[str, str]:
    return replicas_from_slices([model(r) for r in raws], port_name)


def test_only_ready_and_not_terminating_endpoints_take_traffic():
    raw = endpoint_slice(
        "s",
        "llm",
        [
            Endpoint("ready", "10.0.0.1"),
            Endpoint("loading", "10.0.0.2", ready=False),
            Endpoint("unknown", "10.0.0.3", ready=None, terminating=None),  # unset: counts as ready
            # ready *and* terminating happens when the Service publishes not-ready addresses
            Endpoint("draining", "10.0.0.4", ready=True, terminating=True),
            Endpoint("draining-unset", "10.0.0.5", ready=None, terminating=True),
            Endpoint("deleted", "10.0.0.6", ready=False, terminating=True),
        ],
    )
    raw["endpoints"].append({"addresses": ["10.0.0.7"]})  # no conditions at all: ready
    assert replicas(raw) == {"ready": "10.0.0.1:8080", "unknown": "10.0.0.3:8080", "10.0.0.7": "10.0.0.7:8080"}


def test_a_terminating_endpoint_that_still_serves_is_leaving_until_it_stops_serving():
    raw = endpoint_slice("s", "llm", [Endpoint("llm-0", "10.0.0.1"),
                                      Endpoint("llm-1", "10.0.0.2", ready=False, terminating=True)])
    raw["endpoints"].append({"addresses": ["10.0.0.3"], "targetRef": {"kind": "Pod", "name": "llm-2"},
                             "conditions": {"ready": False, "serving": False, "terminating": True}})
    raw["endpoints"].append({"addresses": ["10.0.0.4"], "targetRef": {"kind": "Pod", "name": "llm-3"},
                             "conditions": {"ready": False, "terminating": True}})  # serving unset: not trusted
    kept = snapshot_from_slices([model(raw)], "http", keep_leaving=True)
    assert kept == Snapshot({"llm-0": "10.0.0.1:8080", "llm-1": "10.0.0.2:8080"}, leaving={"llm-1"})
    assert kept != {"llm-0": "10.0.0.1:8080", "llm-1": "10.0.0.2:8080"}, "a plain mapping has no one leaving"
    assert snapshot_from_slices([model(raw)], "http", keep_leaving=False) == {"llm-0": "10.0.0.1:8080"}


def test_names_come_from_the_pod_then_the_hostname_then_the_address():
    raw = endpoint_slice("s", "llm", [Endpoint("llm-0", "10.0.0.1")])
    raw["endpoints"].append({"addresses": ["10.0.0.2"], "hostname": "llm-1"})
    raw["endpoints"].append({"addresses": ["10.0.0.3"], "targetRef": {"kind": "Node", "name": "worker"}})
    assert replicas(raw) == {"llm-0": "10.0.0.1:8080", "llm-1": "10.0.0.2:8080", "10.0.0.3": "10.0.0.3:8080"}


def test_the_named_port_is_used_and_slices_without_it_are_skipped():
    assert replicas(endpoint_slice("s", "llm", [Endpoint("llm-0", "10.0.0.1")], port=9000)) == {
        "llm-0": "10.0.0.1:9000"
    }
    assert replicas(endpoint_slice("s", "llm", [Endpoint("llm-0", "10.0.0.1")], port_name="metrics")) == {}


def test_ipv6_is_bracketed_fqdn_skipped_and_dual_stack_prefers_ipv4():
    v6 = endpoint_slice("v6", "llm", [Endpoint("llm-0", "fd00::1"), Endpoint("llm-1", "fd00::2")], address_type="IPv6")
    v4 = endpoint_slice("v4", "llm", [Endpoint("llm-0", "10.0.0.1")])
    fqdn = endpoint_slice("f", "llm", [Endpoint("llm-9", "llm-9.example")], address_type="FQDN")
    assert replicas(v6, v4, fqdn) == {"llm-0": "10.0.0.1:8080", "llm-1": "[fd00::2]:8080"}
    assert replicas(v4, v6) == replicas(v6, v4), "the order of slices must not matter"


conditions = st.sampled_from([True, False, None])


@settings(max_examples=50)
@given(st.lists(st.tuples(conditions, conditions), max_size=12), st.randoms(use_true_random=False))
def test_every_accepted_pod_appears_once_across_any_split_into_slices(flags, rng):
    endpoints = [Endpoint(f"llm-{i}", f"10.0.{i // 250}.{i % 250 + 1}", r, t) for i, (r, t) in enumerate(flags)]
    rng.shuffle(endpoints)
    cut = rng.randint(0, len(endpoints))
    slices = [endpoint_slice("a", "llm", endpoints[:cut]), endpoint_slice("b", "llm", endpoints[cut:])]
    expected = {e.pod: f"{e.ip}:8080" for e in endpoints if e.ready is not False and e.terminating is not True}
    assert replicas(*slices) == expected
    assert list(replicas(*slices)) == sorted(expected)
