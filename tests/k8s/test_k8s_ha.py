"""The gateway without a single point of failure, checked without a cluster: two or more
replicas, a rolling update that never goes below them, a PodDisruptionBudget over exactly
the gateway pods, one pod per node, the drain timings consistent with each other and with
the router's settings, the store reachable from the gateway pods only; and, live, the
router's preStop command draining a real Envoy started with the pod's own flags, the
store's own command line on a real redis-server."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from k8s_support import REPO, all_docs, find, router_settings

from extproc.envoy.contract import EndpointsFile, write_endpoints_file
from extproc.service.dataplanes.own_envoy_config import render_envoy_config
from extproc.stack.processes import envoy_binary, free_port, spawn_child, wait_until_ready

SERVER_STOP_GRACE_S = 2  # extproc/service/main.py: server.stop(grace=2) after the drain


def deployment(name: str) -> dict[str, Any]:
    return find("Deployment", name)


def pod_labels(name: str) -> dict[str, str]:
    return dict(deployment(name)["spec"]["template"]["metadata"]["labels"])


def gateway_container(name: str) -> dict[str, Any]:
    (container,) = [c for c in deployment("gateway")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels selectors are checked here"
    return bool(selector["matchLabels"].items() <= labels.items())


def workload_labels() -> dict[str, dict[str, str]]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["labels"]
        for d in all_docs()
        if d["kind"] in ("Deployment", "StatefulSet")
    }


def envoy_flag(name: str) -> str:
    args = gateway_container("envoy")["args"]
    return str(args[args.index(name) + 1])


def router_prestop() -> list[str]:
    return list(gateway_container("router")["lifecycle"]["preStop"]["exec"]["command"])


def prestop_option(name: str) -> str:
    command = router_prestop()
    return command[command.index(name) + 1]


# ----------------------------------------------------------------------------- rollout, PDB, spread


def test_the_gateway_runs_at_least_two_replicas_and_rolls_without_going_below():
    spec = deployment("gateway")["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def test_the_disruption_budget_covers_exactly_the_gateway_pods():
    budget = find("PodDisruptionBudget", "gateway")["spec"]
    selector = budget["selector"]
    chosen = [name for name, labels in workload_labels().items() if selects(selector, labels)]
    assert chosen == ["Deployment/gateway"]
    assert selector["matchLabels"] == deployment("gateway")["spec"]["selector"]["matchLabels"]
    replicas = deployment("gateway")["spec"]["replicas"]
    # one pod may go, and one always stays: a drain neither blocks nor empties the gateway
    allowed_down = budget["maxUnavailable"] if "maxUnavailable" in budget else replicas - budget["minAvailable"]
    assert 1 <= allowed_down < replicas


def test_gateway_pods_spread_one_per_node_and_over_zones():
    spec = deployment("gateway")["spec"]["template"]["spec"]
    constraints = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for key, constraint in constraints.items():
        assert constraint["maxSkew"] == 1, key
        assert selects(constraint["labelSelector"], pod_labels("gateway")), key
        assert constraint["matchLabelKeys"] == ["pod-template-hash"], key  # rollouts spread the new pods
    host = constraints["kubernetes.io/hostname"]
    assert host["whenUnsatisfiable"] == "DoNotSchedule" and host["nodeTaintsPolicy"] == "Honor"
    # kind's nodes carry no zone label: a hard zone constraint would leave the pods pending
    assert constraints["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"


def test_readiness_is_the_routers_health():
    probe = gateway_container("router")["readinessProbe"]["grpc"]
    assert probe == {"port": 9002, "service": "envoy.service.ext_proc.v3.ExternalProcessor"}


# ----------------------------------------------------------------------------- drain timings


def test_the_grace_period_covers_the_prestop_wait_the_drain_and_envoys_drain():
    drain_s = router_settings().service.drain_seconds
    wait_s = float(prestop_option("--wait-seconds"))
    envoy_sleep_s = gateway_container("envoy")["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = deployment("gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    envoy_drain_s = float(envoy_flag("--drain-time-s"))
    router_done_s = wait_s + drain_s + SERVER_STOP_GRACE_S  # the router's SIGTERM comes after its preStop
    assert drain_s > 0 and wait_s > 0
    assert envoy_drain_s >= wait_s + drain_s, "Envoy's listeners stay open while the router drains"
    assert envoy_sleep_s >= router_done_s, "Envoy gets its SIGTERM only after the router is done"
    assert grace_s > envoy_sleep_s >= envoy_drain_s
    assert grace_s >= router_done_s
    assert envoy_flag("--drain-strategy") == "immediate", "every response during the drain closes its connection"


def test_the_prestop_drains_the_envoy_of_this_pod():
    admin = prestop_option("--envoy-admin")
    assert router_prestop()[:3] == ["python", "-m", "extproc.service.drain"]
    assert admin == envoy_configmap_admin(), "the address Envoy's admin API listens on in the pod"
    assert admin.startswith("127.0.0.1:"), "the admin API stays on the pod's loopback"


def envoy_configmap_admin() -> str:
    config = json.loads(find("ConfigMap", "gateway-envoy")["data"]["envoy.yaml"])
    socket = config["admin"]["address"]["socket_address"]
    return f"{socket['address']}:{socket['port_value']}"


@pytest.mark.live
def test_the_routers_prestop_puts_an_envoy_with_the_pods_flags_into_its_drain(tmp_path: Path):
    """Envoy with the gateway config on free ports and the envoy container's drain flags; the
    router container's preStop command (its admin address and wait replaced): the next
    response closes its connection, and Envoy stays up (it leaves at its own SIGTERM)."""
    endpoints = tmp_path / "eds" / "replicas.json"
    endpoints.parent.mkdir()
    write_endpoints_file(endpoints, {})
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    (tmp_path / "envoy.yaml").write_text(render_envoy_config(
        listen=listen, admin=admin, ext_proc=None, endpoints=EndpointsFile(str(endpoints)),
        fail_open=True, max_request_bytes=1 << 20, retries=0, replica_key_file=None,
    ))  # fmt: skip
    drain_flags = ["--drain-time-s", envoy_flag("--drain-time-s"), "--drain-strategy", envoy_flag("--drain-strategy")]
    command = [envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--concurrency", "1", "--disable-hot-restart"]
    envoy = spawn_child("envoy", command + drain_flags, tmp_path / "envoy.log")
    try:
        wait_until_ready(envoy, lambda: _answers(f"http://{admin}/ready"), 30.0)
        with httpx.Client(timeout=10) as client:
            assert client.get(f"http://{listen}/").headers.get("connection") != "close"
            prestop = router_prestop()
            prestop[prestop.index("--envoy-admin") + 1] = admin
            prestop[prestop.index("--wait-seconds") + 1] = "0"
            done = subprocess.run([sys.executable, *prestop[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0 and not done.stderr, done.stderr
            assert client.get(f"http://{listen}/").headers.get("connection") == "close"
        stats = httpx.get(f"http://{admin}/stats?filter=downstream_cx_drain_close", timeout=10).text
        assert "http.gateway.downstream_cx_drain_close: 1" in stats
        time.sleep(0.2)
        assert envoy.process.poll() is None
    finally:
        envoy.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- the store


def test_the_router_config_points_at_the_store_service():
    url = urlsplit(router_settings().store.url)
    service = find("Service", url.hostname or "")
    (port,) = service["spec"]["ports"]
    assert url.scheme == "redis" and url.port == port["port"] and url.path == "/0"
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels("store"))
    (redis,) = deployment("store")["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in redis["ports"]}
    assert named[port["targetPort"]] == port["port"]


def test_only_gateway_pods_reach_the_store():
    policy = find("NetworkPolicy", "store")["spec"]
    assert selects(policy["podSelector"], pod_labels("store"))
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == [], "the store reaches nothing"
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}, "no namespaceSelector or ipBlock: this namespace's pods only"
    admitted = [name for name, labels in workload_labels().items() if selects(source["podSelector"], labels)]
    assert admitted == ["Deployment/gateway"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


def store_script() -> str:
    """The store container's shell script: it writes the ACL file, then execs redis-server."""
    command = deployment("store")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"]
    return str(command[2])


def store_command() -> list[str]:
    (line,) = [line for line in store_script().splitlines() if line.startswith("exec redis-server")]
    return shlex.split(line)[1:]


def store_option(name: str) -> str:
    command = store_command()
    return command[command.index(name) + 1]


def test_the_store_is_a_bounded_cache_with_least_privilege():
    spec = deployment("store")["spec"]
    pod = spec["template"]["spec"]
    (redis,) = pod["containers"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}, "never two stores side by side"
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert store_option("--maxmemory-policy") == "volatile-ttl"  # every key has a TTL: one-shots go first
    assert store_option("--protected-mode") == "yes"
    assert (store_option("--save"), store_option("--appendonly")) == ("", "no"), "a cache: nothing on disk"
    maxmemory_mib = int(store_option("--maxmemory").removesuffix("mb"))
    limit_mib = int(redis["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert 0 < maxmemory_mib < limit_mib, "Redis evicts before the kernel kills it"
    assert redis["securityContext"]["readOnlyRootFilesystem"] is True
    assert redis["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert not [d for d in all_docs() if d["kind"] == "RoleBinding" and
                any(s["name"] not in ("router", "slot-sidecar") for s in d["subjects"])], \
        "the store gets no Kubernetes API rights"


@pytest.mark.live
@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server (Debian's, on PATH)")
def test_the_stores_command_line_runs_a_real_redis_as_configured(tmp_path: Path):
    """The container's script with a password file here (and a probe user added to its ACL file,
    to read the config back): the routers' user gets in with the password, nobody without."""
    port = free_port()
    password = tmp_path / "password"
    password.write_text("s3cret-value\n")
    probe = f"printf 'user probe on nopass ~* +@all\\n' >> {tmp_path}/users.acl\nexec redis-server"
    script = (store_script().replace("/run/llm-ring/store/password", str(password)).replace("/data/", f"{tmp_path}/")
              .replace("--port 6379", f"--port {port} --bind 127.0.0.1").replace("exec redis-server", probe))
    redis = spawn_child("redis", ["sh", "-c", script], tmp_path / "redis.log")
    try:
        cli = [shutil.which("redis-cli") or "redis-cli", "-p", str(port), "--user", "probe", "--pass", "x"]

        def ask(*words: str) -> list[str]:
            return subprocess.run([*cli, *words], capture_output=True, text=True).stdout.split("\n")

        def config(key: str) -> str:
            return ask("config", "get", key)[1]

        wait_until_ready(redis, lambda: ask("ping")[0] == "PONG", 20.0)

        assert config("maxmemory-policy") == "volatile-ttl"
        assert int(config("maxmemory")) == int(store_option("--maxmemory").removesuffix("mb")) << 20
        assert (config("save"), config("appendonly"), config("protected-mode")) == ("", "no", "yes")
        anonymous = subprocess.run([cli[0], "-p", str(port), "ping"], capture_output=True, text=True).stdout
        assert "NOAUTH" in anonymous
        routers = [cli[0], "-p", str(port), "--user", "llm-ring", "--pass", "s3cret-value", "--no-auth-warning"]
        stored = subprocess.run([*routers, "set", "llm-ring:place:1", "x"], capture_output=True, text=True).stdout
        assert stored == "OK\n" and (tmp_path / "users.acl").stat().st_mode & 0o077 == 0
        refused = subprocess.run([*routers, "flushall"], capture_output=True, text=True).stdout
        assert "NOPERM" in refused
    finally:
        redis.stop()
