"""The real router process (`llm-ring serve`) with the Kubernetes ConfigMap's settings,
discovering replicas from the fake API server (fake_apiserver.py) through KUBECONFIG:
readiness follows discovery, and the router outlives the API going away and coming back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fake_apiserver import Endpoint, endpoint_slice
from k8s_support import NAMESPACE, ROUTER_TOKEN, find, migration_token_file, replica_key_file

from extproc.service.admin_client import AdminClient
from extproc.service.processor import SERVICE
from extproc.stack.processes import free_port, grpc_serving, start_service

pytestmark = pytest.mark.live


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_router_follows_endpointslices_and_survives_the_api_restarting(apiserver, kubeconfig, tmp_path: Path):
    kubeconfig(ROUTER_TOKEN)
    config = tmp_path / "router.toml"
    config.write_text(find("ConfigMap", "router-config")["data"]["router.toml"])  # the ConfigMap, verbatim
    listen, admin_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {
        "LLM_RING__SERVICE__LISTEN": f'"{listen}"',
        "LLM_RING__SERVICE__ADMIN_LISTEN": f'"{admin_listen}"',
        "LLM_RING__SERVICE__MIGRATION_LISTEN": f'"127.0.0.1:{free_port()}"',  # the ConfigMap's is the pod's address
        "LLM_RING__SERVICE__MIGRATION_TOKEN_FILE": f'"{migration_token_file(tmp_path)}"',
        "LLM_RING__SERVICE__REPLICA_API_KEY_FILE": f'"{replica_key_file(tmp_path)}"',  # the Secret's mount
        "LLM_RING__SERVICE__METRICS_LISTEN": f'"127.0.0.1:{free_port()}"',
        "LLM_RING__DISCOVERY__KUBERNETES__BACKOFF_SECONDS": "0.05",
        "LLM_RING__SERVICE__ENVOY_ENDPOINTS_FILE": f'"{tmp_path / "eds" / "replicas.json"}"',
        "LLM_RING__STORE__PASSWORD_FILE": f'"{tmp_path / "store-password"}"',  # the Secret's mount, here
    }
    (tmp_path / "store-password").write_text("not-the-secret\n")
    apiserver.apply(endpoint_slice("llm-a", "llm", [Endpoint("llm-0", "10.0.0.10", ready=False)], namespace=NAMESPACE))
    service = start_service(tmp_path, env, config)
    try:
        with AdminClient(admin_listen) as admin:

            def replicas() -> dict[str, str]:
                return {r["name"]: r["address"] for r in admin.state()["replicas"]}

            time.sleep(0.5)
            assert not grpc_serving(listen, SERVICE), "not ready while no replica is ready"
            assert replicas() == {}
            apiserver.apply(endpoint_slice("llm-a", "llm", [Endpoint("llm-0", "10.0.0.10")], namespace=NAMESPACE))
            eventually(lambda: grpc_serving(listen, SERVICE))
            assert replicas() == {"llm-0": "10.0.0.10:8080"}

            apiserver.stop()
            time.sleep(0.5)
            assert service.process.poll() is None
            assert replicas() == {"llm-0": "10.0.0.10:8080"} and grpc_serving(listen, SERVICE)
            apiserver.apply(endpoint_slice("llm-b", "llm", [Endpoint("llm-1", "10.0.0.11")], namespace=NAMESPACE))
            apiserver.start()
            eventually(lambda: replicas() == {"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"})
            # Envoy's replica file follows too
            eds = json.loads((tmp_path / "eds" / "replicas.json").read_text())
            hosts = [e["endpoint"]["hostname"] for e in eds["resources"][0]["endpoints"][0]["lb_endpoints"]]
            assert hosts == ["llm-0", "llm-1"]
    finally:
        service.stop()
    events = [json.loads(line) for line in service.log_path.read_text().splitlines() if line.startswith("{")]
    changes = [e["replicas"] for e in events if e["event"] == "replicas_changed" and "added" in e]
    assert changes == [[], ["llm-0"], ["llm-0", "llm-1"]]
    assert any(e["event"] == "kubernetes_api_unreachable" for e in events)
