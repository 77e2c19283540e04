"""Shared by the Kubernetes tests: the manifests in k8s/, the router settings, the Envoy generator.

(A uniquely named module: test files import it by name; `conftest` names clash across test folders.)
"""

from __future__ import annotations

import functools
import importlib.util
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


def manifest_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


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


def router_settings_raw() -> dict[str, Any]:
    return tomllib.loads(find("ConfigMap", "router-config")["data"]["router.toml"])


def router_settings() -> Settings:
    return parse_settings(router_settings_raw(), source="k8s/41-router-config.yaml")


def envoy_configmap() -> ModuleType:
    """k8s/envoy_configmap.py, the generator of the Envoy ConfigMap (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("envoy_configmap", K8S / "envoy_configmap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
