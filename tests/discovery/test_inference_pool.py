"""InferencePool discovery driven by the official `kubernetes` client against the fake API
server of fake_apiserver.py (see its docstring for what the fake does not model), with the
picker's settings and RBAC from k8s/inference-pool/.

Every InferencePool a test writes is first validated against the openAPIV3Schema of the
official CRD (tests/k8s/schemas/, vendored with its source and commit), every Pod against
the Kubernetes schemas (kubernetes-validate, strict): the API server would store them as they are.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from crd_schemas import validate_custom
from fake_apiserver import FakeApiServer, identity_from_manifests, inference_pool, pod
from hypothesis import given
from hypothesis import strategies as st
from k8s_support import NAMESPACE, PICKER_TOKEN, find, picker_docs, picker_settings, schema_version
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from structlog.testing import capture_logs
from watch_support import Reader, requests_of, wait

from extproc.discovery import Snapshot, leaving_of
from extproc.discovery.inference_pool import InferencePoolDiscovery, InvalidPoolError, replicas_from_pool
from extproc.discovery.plugin import make_discovery

FAST = {"watch_timeout_seconds": 30, "max_backoff_seconds": 0.2}
LLM = {"app.kubernetes.io/name": "llm"}


def pool_of(match_labels: Mapping[str, str] = LLM, ports: tuple[int, ...] = (8080,), name: str = "llm") -> dict:
    pool = inference_pool(name, match_labels, ports, namespace=NAMESPACE)
    validate_custom(pool)
    return pool


def pod_of(name: str, ip: str | None, labels: Mapping[str, str] = LLM, **state: Any) -> dict:
    obj = pod(name, ip, labels, namespace=NAMESPACE, **state)
    kubernetes_validate.validate(obj, schema_version(), strict=True)
    return obj


def discovery_settings() -> tuple[Any, Any]:
    # The committed picker ConfigMap's [discovery]: its source's section, with a test-sized first
    # backoff, and the shared keys.
    discovery = picker_settings().discovery
    return discovery.section.model_copy(update={"backoff_seconds": 0.05}), discovery


def pool_reader() -> Reader:
    return Reader(InferencePoolDiscovery(*discovery_settings(), **FAST))


async def both_watching(apiserver: FakeApiServer) -> None:
    await wait(lambda: apiserver.watch_count() == 2)


def lists_of(apiserver: FakeApiServer, resource: str) -> list[Any]:
    return [r for r in requests_of(apiserver, "list", 200) if r.path.endswith("/" + resource)]


# ----------------------------------------------------------------------------- the core


def model(raw: dict[str, Any]) -> Any:
    return client.ApiClient().deserialize(json.dumps(raw), "V1Pod", "application/json")


def test_the_committed_pool_selects_the_replicas_of_k8s_and_is_what_the_picker_watches():
    (pool,) = [d for d in picker_docs() if d["kind"] == "InferencePool"]
    validate_custom(pool)
    statefulset = find("StatefulSet", "llm")
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (llama,) = [c for c in statefulset["spec"]["template"]["spec"]["containers"] if c["name"] == "llama"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [llama["ports"][0]["containerPort"]]
    settings = picker_settings().discovery
    assert (settings.source, settings.section.name) == ("inference-pool", pool["metadata"]["name"])
    assert settings.section.namespace == pool["metadata"]["namespace"] == NAMESPACE
    assert isinstance(make_discovery(settings), InferencePoolDiscovery)


def test_only_ready_not_terminating_selected_pods_with_an_address_are_replicas():
    pods = [
        pod_of("llm-0", "10.0.0.10"),
        pod_of("llm-1", "10.0.0.11", ready=False),  # loading its model
        pod_of("llm-2", "10.0.0.12", deleting=True),  # terminating: still Ready during its preStop
        pod_of("llm-3", None, ready=False),  # not started yet
        pod_of("other-0", "10.0.9.9", {"app.kubernetes.io/name": "other"}),
        pod_of("llm-4", "fd00::4"),
    ]
    assert replicas_from_pool(pool_of(), [model(p) for p in pods]) == {
        "llm-0": "10.0.0.10:8080",
        "llm-4": "[fd00::4]:8080",
    }
    assert replicas_from_pool(pool_of(), [model(p) for p in pods], keep_leaving=True) == Snapshot(
        {"llm-0": "10.0.0.10:8080", "llm-2": "10.0.0.12:8080", "llm-4": "[fd00::4]:8080"}, leaving={"llm-2"})
    assert replicas_from_pool(None, [model(p) for p in pods]) == {}


def test_each_target_port_is_a_replica_the_first_named_after_the_pod():
    dual = pod_of("llm-0", "10.0.0.10", ports=(8080, 8081, 8082))
    dual["status"]["podIPs"] = [{"ip": "fd00::10"}, {"ip": "10.0.0.10"}]  # dual-stack: IPv4 wins
    assert replicas_from_pool(pool_of(ports=(8080, 8081, 8082)), [model(dual)]) == {
        "llm-0": "10.0.0.10:8080",
        "llm-0-rank-1": "10.0.0.10:8081",
        "llm-0-rank-2": "10.0.0.10:8082",
    }


def test_the_official_schema_refuses_what_the_core_would_refuse():
    for broken in ({"selector": {"matchLabels": {}}}, {"targetPorts": []}, {"targetPorts": [{"number": 0}]}):
        pool = pool_of()
        pool["spec"] |= broken
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(pool)
        with pytest.raises(InvalidPoolError):
            replicas_from_pool(pool, [])
    misspelled = pool_of()
    misspelled["spec"]["targetPort"] = misspelled["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError, match="targetPort"):
        validate_custom(misspelled)


label_values = st.sampled_from(["llm", "other", "x"])


@given(
    selector=st.dictionaries(st.sampled_from(["app", "tier"]), label_values, min_size=1),
    pods=st.lists(
        st.tuples(
            st.dictionaries(st.sampled_from(["app", "tier", "zone"]), label_values), st.booleans(), st.booleans()
        ),
        max_size=6,
    ),
    ports=st.lists(st.integers(1, 65535), min_size=1, max_size=3, unique=True),
)
def test_a_replica_per_matching_ready_pod_and_port(selector, pods, ports):
    models = [
        model(pod(f"p-{i}", f"10.0.0.{i + 1}", labels, ready=ready, deleting=deleting))
        for i, (labels, ready, deleting) in enumerate(pods)
    ]
    replicas = replicas_from_pool(inference_pool("llm", selector, ports), models)
    chosen = [
        i
        for i, (labels, ready, deleting) in enumerate(pods)
        if selector.items() <= labels.items() and ready and not deleting
    ]
    assert len(replicas) == len(chosen) * len(ports)
    for i in chosen:
        assert replicas[f"p-{i}"] == f"10.0.0.{i + 1}:{ports[0]}"
    assert list(replicas) == sorted(replicas)


# ----------------------------------------------------------------------------- watched


def test_pods_join_and_leave_as_they_turn_ready_unready_and_terminating(apiserver, kubeconfig):
    kubeconfig(PICKER_TOKEN)  # the picker's RBAC (k8s/inference-pool/10-picker-rbac.yaml)
    apiserver.apply(pool_of())
    apiserver.apply(pod_of("llm-0", "10.0.0.10"))
    apiserver.apply(pod_of("llm-1", "10.0.0.11", ready=False))
    apiserver.apply(pod_of("store-0", "10.0.9.9", {"app.kubernetes.io/name": "store"}))

    async def scenario() -> Reader:
        reader = pool_reader()
        try:
            await reader.until({"llm-0": "10.0.0.10:8080"})
            apiserver.apply(pod_of("llm-1", "10.0.0.11"))  # its model loaded
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"})
            apiserver.apply(pod_of("llm-2", "10.0.0.12"))  # scaled up
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080", "llm-2": "10.0.0.12:8080"})
            apiserver.apply(pod_of("llm-0", "10.0.0.10", deleting=True))  # being deleted, preStop running
            await reader.until(Snapshot({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080",
                                         "llm-2": "10.0.0.12:8080"}, leaving={"llm-0"}))
            apiserver.delete(NAMESPACE, "llm-0", "Pod")
            apiserver.apply(pod_of("llm-0", "10.0.0.20", ready=False))  # recreated, loading
            # each change read before the next: two in a row may reach the reader as one snapshot
            await reader.until({"llm-1": "10.0.0.11:8080", "llm-2": "10.0.0.12:8080"})
            apiserver.apply(pod_of("llm-1", "10.0.0.11", ready=False))  # readiness probe failing
            await reader.until({"llm-2": "10.0.0.12:8080"})
            apiserver.apply(pod_of("llm-0", "10.0.0.20"))  # back, same name, new address
            await reader.until({"llm-0": "10.0.0.20:8080", "llm-2": "10.0.0.12:8080"})
            assert reader.max_stall < 2.0, f"the event loop stalled {reader.max_stall:.3f}s"
        finally:
            await reader.close()
        return reader

    with capture_logs() as logs:
        reader = asyncio.run(scenario())
    assert [sorted(s) for s in reader.snapshots] == [
        ["llm-0"],
        ["llm-0", "llm-1"],
        ["llm-0", "llm-1", "llm-2"],
        ["llm-0", "llm-1", "llm-2"],  # llm-0 leaving
        ["llm-1", "llm-2"],
        ["llm-2"],
        ["llm-0", "llm-2"],
    ]
    changes = [e for e in logs if e["event"] == "replicas_changed"]
    assert changes[0]["inference_pool"] == f"{NAMESPACE}/llm" and changes[3]["leaving"] == ["llm-0"]
    assert changes[4]["removed"] == ["llm-0"] and changes[4]["leaving"] == []
    assert len(lists_of(apiserver, "pods")) == len(lists_of(apiserver, "inferencepools")) == 1, "no relist"
    pool_watch = next(r for r in requests_of(apiserver, "watch") if r.path.endswith("/inferencepools"))
    assert pool_watch.query["fieldSelector"] == "metadata.name=llm", "RBAC grants this one pool by name"


def test_a_changed_selector_or_port_takes_effect_without_relisting(apiserver, kubeconfig):
    kubeconfig(PICKER_TOKEN)
    blue = {"app.kubernetes.io/name": "llm", "track": "blue"}
    green = {"app.kubernetes.io/name": "llm", "track": "green"}
    apiserver.apply(pool_of(blue))
    apiserver.apply(pod_of("llm-0", "10.0.0.10", blue, ports=(8080, 8081)))
    apiserver.apply(pod_of("llm-g0", "10.0.1.10", green, ports=(8080, 8081)))

    async def scenario() -> None:
        reader = pool_reader()
        try:
            await reader.until({"llm-0": "10.0.0.10:8080"})
            await both_watching(apiserver)
            apiserver.apply(pool_of(green))  # the pool moves to the green pods
            await reader.until({"llm-g0": "10.0.1.10:8080"})
            apiserver.apply(pool_of(green, ports=(8081,)))
            await reader.until({"llm-g0": "10.0.1.10:8081"})
            apiserver.apply(pool_of(green, ports=(8080, 8081)))
            await reader.until({"llm-g0": "10.0.1.10:8080", "llm-g0-rank-1": "10.0.1.10:8081"})
            apiserver.apply(pool_of(LLM, ports=(8080, 8081)))  # both tracks
            await reader.until({
                "llm-0": "10.0.0.10:8080", "llm-0-rank-1": "10.0.0.10:8081",
                "llm-g0": "10.0.1.10:8080", "llm-g0-rank-1": "10.0.1.10:8081",
            })  # fmt: skip
        finally:
            await reader.close()

    asyncio.run(scenario())
    assert len(lists_of(apiserver, "pods")) == 1, "a new selector needs no new pod list"


def test_a_deleted_pool_leaves_no_replicas_until_it_is_created_again(apiserver, kubeconfig):
    kubeconfig(PICKER_TOKEN)
    apiserver.apply(pod_of("llm-0", "10.0.0.10"))
    apiserver.apply(pool_of(name="another-pool"))  # not ours: neither seen nor allowed

    async def scenario() -> None:
        reader = pool_reader()
        try:
            await wait(lambda: reader.snapshots == [{}])  # no pool yet: no replicas, and ready to be told
            await both_watching(apiserver)
            apiserver.apply(pool_of())
            await reader.until({"llm-0": "10.0.0.10:8080"})
            apiserver.delete(NAMESPACE, "llm", "InferencePool")
            await reader.until({})
            apiserver.apply(pool_of())
            await reader.until({"llm-0": "10.0.0.10:8080"})
        finally:
            await reader.close()

    with capture_logs() as logs:
        asyncio.run(scenario())
    assert any(e["event"] == "inference_pool_missing" for e in logs)
    assert not requests_of(apiserver, "list", 403) and not requests_of(apiserver, "watch", 403)


@pytest.mark.parametrize("drop", ["410 Gone", "API restarted"])
def test_a_dropped_watch_relists_and_neither_loses_nor_duplicates_replicas(apiserver, kubeconfig, drop):
    kubeconfig(PICKER_TOKEN)
    apiserver.apply(pool_of())
    apiserver.apply(pod_of("llm-0", "10.0.0.10"))
    apiserver.apply(pod_of("llm-1", "10.0.0.11"))
    before = {"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"}

    async def scenario() -> Reader:
        reader = pool_reader()
        try:
            await reader.until(before)
            await both_watching(apiserver)
            if drop == "410 Gone":  # changes while no watch is open, then the history is compacted
                apiserver.hold_watches()
                apiserver.end_watches()
                await wait(lambda: apiserver.watch_count() == 0)
            else:  # every connection cut; changes while the API is away
                apiserver.stop()
            apiserver.delete(NAMESPACE, "llm-0", "Pod")  # a DELETED event no watch will see
            apiserver.apply(pod_of("llm-1", "10.0.0.11", deleting=True))
            apiserver.apply(pod_of("llm-2", "10.0.0.12"))
            apiserver.apply(pod_of("llm-3", "10.0.0.13", {"app.kubernetes.io/name": "llm", "v": "2"}))
            apiserver.apply(pool_of({"app.kubernetes.io/name": "llm", "v": "2"}))
            if drop == "410 Gone":
                apiserver.compact()
                apiserver.release_watches()
            else:
                apiserver.start()
            await reader.until({"llm-3": "10.0.0.13:8080"})
            await both_watching(apiserver)
            apiserver.apply(pod_of("llm-4", "10.0.0.14", {"app.kubernetes.io/name": "llm", "v": "2"}))
            await reader.until({"llm-3": "10.0.0.13:8080", "llm-4": "10.0.0.14:8080"})
        finally:
            await reader.close()
        return reader

    with capture_logs() as logs:
        reader = asyncio.run(scenario())
    # never a replica the API no longer had, never a set between the old and the relisted one
    assert reader.snapshots[0] == before
    relisted, after = {"llm-3": "10.0.0.13:8080"}, {"llm-3": "10.0.0.13:8080", "llm-4": "10.0.0.14:8080"}
    assert reader.snapshots[-2:] == [relisted, after]
    for snapshot in reader.snapshots[1:]:  # llm-1, being deleted while Ready, only ever as leaving
        assert "llm-0" not in snapshot and ("llm-1" not in snapshot or "llm-1" in leaving_of(snapshot)), snapshot
    if drop == "410 Gone":
        assert len(lists_of(apiserver, "pods")) == len(lists_of(apiserver, "inferencepools")) == 2, "one relist each"
        assert {"pod_watch_expired", "inferencepool_watch_expired"} <= {e["event"] for e in logs}
    else:  # a watch that reconnects after the restart resumes from its version: it need not relist
        assert 1 <= len(lists_of(apiserver, "pods")) <= 2 and 1 <= len(lists_of(apiserver, "inferencepools")) <= 2
        outages = [e for e in logs if e["event"] == "kubernetes_api_unreachable"]
        assert outages and outages[0]["serving"] == sorted(before), "the last known set keeps serving"


def test_the_picker_token_reads_its_pool_and_the_pods_and_nothing_else(apiserver):
    configuration = client.Configuration(host=apiserver.url)
    configuration.api_key = {"authorization": PICKER_TOKEN}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    pools = ("inference.networking.k8s.io", "v1")
    with client.ApiClient(configuration) as api_client:
        core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
        discovery = client.DiscoveryV1Api(api_client)
        core.list_namespaced_pod(NAMESPACE)  # allowed
        custom.list_namespaced_custom_object(*pools, NAMESPACE, "inferencepools", field_selector="metadata.name=llm")
        refused = {
            "every pool": lambda: custom.list_namespaced_custom_object(*pools, NAMESPACE, "inferencepools"),
            "another pool": lambda: custom.list_namespaced_custom_object(
                *pools, NAMESPACE, "inferencepools", field_selector="metadata.name=other"
            ),
            "get the pool": lambda: custom.get_namespaced_custom_object(*pools, NAMESPACE, "inferencepools", "llm"),
            "get a pod": lambda: core.read_namespaced_pod("llm-0", NAMESPACE),
            "pods elsewhere": lambda: core.list_namespaced_pod("default"),
            "pools elsewhere": lambda: custom.list_namespaced_custom_object(
                *pools, "default", "inferencepools", field_selector="metadata.name=llm"
            ),
            "secrets": lambda: core.list_namespaced_secret(NAMESPACE),
            "services": lambda: core.list_namespaced_service(NAMESPACE),
            "endpointslices": lambda: discovery.list_namespaced_endpoint_slice(NAMESPACE),
            "delete a pod": lambda: core.delete_namespaced_pod("llm-0", NAMESPACE),
        }
        for what, call in refused.items():
            with pytest.raises(ApiException) as denied:
                call()
            assert denied.value.status == 403, what
            assert "system:serviceaccount:llm-ring:picker" in denied.value.body, what


def test_the_picker_role_is_exactly_what_discovery_reads():
    role = next(d for d in picker_docs() if d["kind"] == "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "resourceNames": [picker_settings().discovery.section.name],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]
    identity = identity_from_manifests(picker_docs(), NAMESPACE, "picker")
    assert {ns for ns, _ in identity.rules} == {NAMESPACE}, "its namespace only"


def test_a_pool_it_may_not_read_publishes_nothing_and_recovers_when_granted(apiserver, kubeconfig):
    """A Role naming another pool: the pods list, the pool is refused; no half-known set is
    published (the service stays not ready), and the corrected Role is picked up alone."""
    kubeconfig(PICKER_TOKEN)
    docs = copy.deepcopy(picker_docs())
    role = next(d for d in docs if d["kind"] == "Role")
    role["rules"][0]["resourceNames"] = ["another-pool"]
    apiserver.identities[PICKER_TOKEN] = identity_from_manifests(docs, NAMESPACE, "picker")
    apiserver.apply(pool_of())
    apiserver.apply(pod_of("llm-0", "10.0.0.10"))

    async def scenario() -> Reader:
        reader = pool_reader()
        try:
            await wait(lambda: len(requests_of(apiserver, "list", 403)) >= 3)
            assert reader.snapshots == []
            apiserver.identities[PICKER_TOKEN] = identity_from_manifests(picker_docs(), NAMESPACE, "picker")
            await reader.until({"llm-0": "10.0.0.10:8080"})
        finally:
            await reader.close()
        return reader

    with capture_logs() as logs:
        reader = asyncio.run(scenario())
    assert reader.snapshots == [{"llm-0": "10.0.0.10:8080"}]
    refused = [e for e in logs if e["event"] == "kubernetes_api_error"]
    assert refused and {(e["resource"], e["status"]) for e in refused} == {("inferencepool", 403)}
