"""Shared by the Kubernetes tests: the manifests in k8s/, the router settings, the Envoy generator.

(A uniquely named module: test files import it by name; `conftest` names clash across test folders.)
"""

from __future__ import annotations

import functools
import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from extproc.settings import Settings, parse_settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
NAMESPACE = "llm-ring"
ROUTER_TOKEN = "router-sa-token"
UNBOUND_TOKEN = "unbound-sa-token"  # a ServiceAccount no RoleBinding names
INFERENCE_POOL = K8S / "inference-pool"  # llm-ring as an InferencePool's picker
GATEWAY_FOLDERS = ("envoy-ai-gateway", "kgateway")  # one per gateway, beside INFERENCE_POOL's files
PICKER_TOKEN = "picker-sa-token"
KIND_CONFIG = REPO / "kind" / "kind-config.yaml"
MIGRATION_TOKEN = "the-migration-token"  # the Secret llm-ring-migration's, here
REPLICA_KEY = "the-replica-key"  # the Secret llm-ring-replica-key's, here
# every model's replicas (k8s/20-llm.yaml, k8s/two-models/): the Service llm, the NetworkPolicies, the PDB
REPLICAS = {"app.kubernetes.io/component": "replica"}


def migration_token_file(folder: Path) -> Path:
    """Where a test's router or sidecar reads the migration token (the Secret's mount, here)."""
    path = folder / "migration-token"
    path.write_text(MIGRATION_TOKEN + "\n")
    return path


def replica_key_file(folder: Path) -> Path:
    """Where a test's replicas, picker or sidecar read the replicas' API key (the Secret
    llm-ring-replica-key's mount, here)."""
    path = folder / "replica-key"
    path.write_text(REPLICA_KEY + "\n")
    return path


def manifest_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def picker_manifest_files(folder: Path = INFERENCE_POOL) -> list[Path]:
    """What `kubectl apply -f <folder>` reads: its *.yaml, not its subfolders."""
    return sorted(folder.glob("*.yaml"))


@functools.cache
def picker_docs() -> list[dict[str, Any]]:
    """Every object in k8s/inference-pool/ (not its gateway folders)."""
    return [doc for path in picker_manifest_files() for doc in load_docs(path)]


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@functools.cache
def all_docs() -> list[dict[str, Any]]:
    """Every object in k8s/, parsed once (callers copy before changing one)."""
    return [doc for path in manifest_files() for doc in load_docs(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name} in k8s/, found {len(matches)}"
    return matches[0]


def kind_kubernetes_version() -> str:
    nodes = load_docs(KIND_CONFIG)[0]["nodes"]
    images = {node["image"] for node in nodes}
    assert len(images) == 1, f"all kind nodes must run one image, got {images}"
    match = re.fullmatch(r"kindest/node:v(\d+\.\d+\.\d+)@sha256:[0-9a-f]{64}", images.pop())
    assert match, "pin the kind node image by tag and digest, as kind's release notes ask"
    return match.group(1)


def schema_version() -> str:
    """kubernetes-validate ships schemas per minor version (x.y.0)."""
    major, minor, _ = kind_kubernetes_version().split(".")
    return f"{major}.{minor}.0"


def router_settings_raw() -> dict[str, Any]:
    return tomllib.loads(find("ConfigMap", "router-config")["data"]["router.toml"])


def router_settings() -> Settings:
    return parse_settings(router_settings_raw(), source="k8s/41-router-config.yaml")


def picker_settings_raw() -> dict[str, Any]:
    (configmap,) = [d for d in picker_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "picker-config"]
    return tomllib.loads(configmap["data"]["router.toml"])


def picker_settings() -> Settings:
    return parse_settings(picker_settings_raw(), source="k8s/inference-pool/20-picker-config.yaml")


def envoy_configmap() -> ModuleType:
    """k8s/envoy_configmap.py, the generator of the Envoy ConfigMap."""
    return k8s_script("envoy_configmap")


def k8s_script(name: str) -> ModuleType:
    """k8s/<name>.py, one of the manifests' generators (a script, not a package)."""
    spec = importlib.util.spec_from_file_location(name, K8S / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
