"""Fixtures for the Kubernetes tests (tests/k8s, tests/discovery): a fake API server and a
kubeconfig pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fake_apiserver import ADMIN, FakeApiServer, identity_from_manifests
from k8s_support import NAMESPACE, PICKER_TOKEN, ROUTER_TOKEN, UNBOUND_TOKEN, all_docs, picker_docs


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    identities = {
        ROUTER_TOKEN: identity_from_manifests(all_docs(), NAMESPACE, "router"),
        PICKER_TOKEN: identity_from_manifests(picker_docs(), NAMESPACE, "picker"),
        UNBOUND_TOKEN: identity_from_manifests([], NAMESPACE, "unbound"),
        ADMIN: identity_from_manifests([], "kube-system", "admin"),
    }
    server = FakeApiServer(identities).start()
    yield server
    server.stop()


@pytest.fixture
def kubeconfig(tmp_path: Path, apiserver: FakeApiServer, monkeypatch: pytest.MonkeyPatch):
    """Point KUBECONFIG at the fake server, as a user's kubeconfig would point at kind."""

    def write(token: str) -> Path:
        path = tmp_path / f"kubeconfig-{token}"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": apiserver.url}}],
                    "users": [{"name": "router", "user": {"token": token}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": NAMESPACE}}
                    ],
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        return path

    return write
