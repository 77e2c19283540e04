"""EndpointSlice discovery driven by the official `kubernetes` client against the fake API
server of fake_apiserver.py (see its docstring for what the fake does not model).

No real API server can run on these machines (no Docker, no registry ships one); the
`cluster`-marked tests in test_k8s_cluster.py run the same discovery against a real
cluster when KUBECONFIG is set.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
import time
from typing import Any

import pytest
from fake_apiserver import Endpoint, FakeApiServer, endpoint_slice, identity_from_manifests
from k8s_support import NAMESPACE, ROUTER_TOKEN, UNBOUND_TOKEN, all_docs, router_settings
from kubernetes.config import incluster_config
from structlog.testing import capture_logs
from watch_support import Reader, requests_of, wait

from extproc.discovery import Snapshot
from extproc.discovery.kubernetes import KubernetesDiscovery
from extproc.discovery.watch import KubernetesCredentialsError

FAST = {"watch_timeout_seconds": 30, "max_backoff_seconds": 0.2}


def discovery_settings() -> tuple[Any, Any]:
    # The committed router ConfigMap's [discovery]: its source's section, with a test-sized first
    # backoff, and the shared keys.
    discovery = router_settings().discovery
    return discovery.section.model_copy(update={"backoff_seconds": 0.05}), discovery


def slice_of(name: str, *endpoints: Endpoint, service: str = "llm") -> dict[str, Any]:
    return endpoint_slice(name, service, endpoints, namespace=NAMESPACE)


async def watching(apiserver: FakeApiServer, expected: dict[str, str]) -> Reader:
    """A reader whose discovery has listed ``expected`` and holds its watch open."""
    reader = Reader(KubernetesDiscovery(*discovery_settings(), **FAST))
    await reader.until(expected)
    await wait(lambda: apiserver.watch_count() == 1)
    return reader


def test_replicas_join_when_ready_and_leave_when_not_ready_or_terminating(apiserver, kubeconfig):
    kubeconfig(ROUTER_TOKEN)  # the real path: credentials from KUBECONFIG
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10"), Endpoint("llm-1", "10.0.0.11", ready=False)))
    apiserver.apply(slice_of("other-a", Endpoint("other-0", "10.0.9.9"), service="other"))

    async def scenario() -> None:
        reader = Reader(KubernetesDiscovery(*discovery_settings(), **FAST))
        try:
            await reader.until({"llm-0": "10.0.0.10:8080"})  # llm-1 still loading its model
            apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10"), Endpoint("llm-1", "10.0.0.11")))
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"})
            apiserver.apply(slice_of("llm-b", Endpoint("llm-2", "10.0.0.12")))  # a second slice
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080", "llm-2": "10.0.0.12:8080"})
            # llm-0 is being deleted: terminating, still serving its in-flight requests
            apiserver.apply(
                slice_of(
                    "llm-a",
                    Endpoint("llm-0", "10.0.0.10", ready=False, terminating=True),
                    Endpoint("llm-1", "10.0.0.11"),
                )
            )
            await reader.until(Snapshot({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080",
                                         "llm-2": "10.0.0.12:8080"}, leaving={"llm-0"}))
            apiserver.apply(slice_of("llm-a", Endpoint("llm-1", "10.0.0.11")))  # its drain over, gone
            await reader.until({"llm-1": "10.0.0.11:8080", "llm-2": "10.0.0.12:8080"})
            # restarted llm-1 comes back with a new IP under the same name
            apiserver.apply(slice_of("llm-a", Endpoint("llm-1", "10.0.0.21")))
            await reader.until({"llm-1": "10.0.0.21:8080", "llm-2": "10.0.0.12:8080"})
            apiserver.delete(NAMESPACE, "llm-b")
            await reader.until({"llm-1": "10.0.0.21:8080"})
            stall = reader.max_stall
        finally:
            await reader.close()
        assert [sorted(s) for s in reader.snapshots] == [
            ["llm-0"],
            ["llm-0", "llm-1"],
            ["llm-0", "llm-1", "llm-2"],
            ["llm-0", "llm-1", "llm-2"],  # llm-0 leaving
            ["llm-1", "llm-2"],
            ["llm-1", "llm-2"],
            ["llm-1"],
        ]
        assert [sorted(getattr(s, "leaving", ())) for s in reader.snapshots][2:5] == [[], ["llm-0"], []]
        # A watch on the loop would stall it until the next event or the 30 s watch timeout;
        # the bound leaves room for scheduling noise on a loaded 2-core machine.
        assert stall < 2.0, f"the event loop stalled {stall:.3f}s: discovery must not block it"

    with capture_logs() as logs:
        asyncio.run(scenario())
    changes = [e for e in logs if e["event"] == "replicas_changed"]
    assert [c["replicas"] for c in changes][:2] == [["llm-0"], ["llm-0", "llm-1"]]
    assert changes[3]["leaving"] == ["llm-0"] and changes[3]["removed"] == []
    assert changes[4]["removed"] == ["llm-0"] and changes[4]["endpoints"]["llm-1"] == "10.0.0.11:8080"
    assert len(requests_of(apiserver, "list")) == 1, "one list, then one uninterrupted watch"
    watches = requests_of(apiserver, "watch")
    assert watches[0].query["labelSelector"] == "kubernetes.io/service-name=llm"
    assert watches[0].query["allowWatchBookmarks"] == "true"


def test_watch_resumes_from_a_bookmark_without_relisting(apiserver, kubeconfig):
    kubeconfig(ROUTER_TOKEN)
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10")))

    async def scenario() -> None:
        reader = await watching(apiserver, {"llm-0": "10.0.0.10:8080"})
        try:
            apiserver.apply(slice_of("x", Endpoint("x-0", "10.0.9.9"), service="other"))  # not ours
            bookmark = apiserver.bookmark()
            await asyncio.sleep(0.2)
            apiserver.compact()  # versions before the bookmark are gone
            apiserver.end_watches()  # as when timeoutSeconds runs out
            await wait(lambda: len(requests_of(apiserver, "watch")) == 2)
            assert requests_of(apiserver, "watch")[1].query["resourceVersion"] == str(bookmark)
            apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10"), Endpoint("llm-1", "10.0.0.11")))
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"})
        finally:
            await reader.close()

    asyncio.run(scenario())
    assert len(requests_of(apiserver, "list")) == 1, "a bookmark's version must spare the relist"


def test_relists_after_410_gone_and_catches_up(apiserver, kubeconfig):
    kubeconfig(ROUTER_TOKEN)
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10")))

    async def scenario() -> None:
        reader = await watching(apiserver, {"llm-0": "10.0.0.10:8080"})
        try:
            apiserver.hold_watches()
            apiserver.end_watches()
            await wait(lambda: apiserver.watch_count() == 0)
            # while the client has no watch open: a change, then the history is compacted
            apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10"), Endpoint("llm-1", "10.0.0.11")))
            apiserver.compact()
            apiserver.release_watches()
            await reader.until({"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"})
        finally:
            await reader.close()

    with capture_logs() as logs:
        asyncio.run(scenario())
    assert len(requests_of(apiserver, "list")) == 2, "410 Gone must trigger exactly one relist"
    assert any(e["event"] == "endpointslice_watch_expired" for e in logs)


def test_keeps_the_last_set_while_the_api_is_away_and_recovers(apiserver, kubeconfig):
    kubeconfig(ROUTER_TOKEN)
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10"), Endpoint("llm-1", "10.0.0.11")))
    both = {"llm-0": "10.0.0.10:8080", "llm-1": "10.0.0.11:8080"}

    def outages(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in logs if e["event"] == "kubernetes_api_unreachable"]

    async def scenario(logs: list[dict[str, Any]]) -> None:
        reader = Reader(KubernetesDiscovery(*discovery_settings(), **FAST))
        try:
            await reader.until(both)
            apiserver.stop()  # connections cut, then connection refused
            apiserver.apply(slice_of("llm-b", Endpoint("llm-2", "10.0.0.12")))  # changes while away
            await wait(lambda: len(outages(logs)) >= 4, timeout=20)
            await asyncio.sleep(0.5)
            # backoff 0.05, 0.1, 0.2, 0.2...: a few more retries in 0.5 s, not hundreds
            assert len(outages(logs)) <= 4 + 6, f"{len(outages(logs))} retries: no backoff?"
            assert reader.snapshots == [both], "the last known set stays in service"
            apiserver.start()  # same port, same state
            await reader.until(both | {"llm-2": "10.0.0.12:8080"})
        finally:
            await reader.close()

    with capture_logs() as logs:
        asyncio.run(scenario(logs))
    assert outages(logs)[0]["serving"] == ["llm-0", "llm-1"]
    assert [e["retry_in_s"] for e in outages(logs)[:4]] == [0.05, 0.1, 0.2, 0.2]


@pytest.mark.parametrize("token, status", [("no-such-token", 401), (UNBOUND_TOKEN, 403)])
def test_refused_credentials_back_off_then_recover_when_granted(apiserver, kubeconfig, token, status):
    kubeconfig(token)
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10")))

    async def scenario() -> None:
        reader = Reader(KubernetesDiscovery(*discovery_settings(), **FAST))
        try:
            await wait(lambda: len(requests_of(apiserver, "list", status)) >= 3, timeout=20)
            await asyncio.sleep(0.5)
            refused = len(requests_of(apiserver, "list", status))
            assert refused <= 3 + 6, f"{refused} refused lists: no backoff?"
            assert reader.snapshots == []
            # the RoleBinding gets applied (or the token fixed): discovery recovers alone
            apiserver.identities[token] = identity_from_manifests(all_docs(), NAMESPACE, "router")
            await reader.until({"llm-0": "10.0.0.10:8080"})
        finally:
            await reader.close()

    with capture_logs() as logs:
        asyncio.run(scenario())
    errors = [e for e in logs if e["event"] == "kubernetes_api_error"]
    assert errors and all(e["status"] == status for e in errors)


def test_stopping_the_iteration_ends_the_watch_thread(apiserver, kubeconfig):
    kubeconfig(ROUTER_TOKEN)
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10")))

    async def scenario() -> float:
        snapshots = KubernetesDiscovery(*discovery_settings(), **FAST).snapshots()
        assert await anext(snapshots) == {"llm-0": "10.0.0.10:8080"}
        await wait(lambda: apiserver.watch_count() == 1)
        start = time.monotonic()
        await snapshots.aclose()
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert took < 2.0, f"closing took {took:.2f}s"
    assert not [t for t in threading.enumerate() if t.name == "k8s-discovery"]
    deadline = time.monotonic() + 2
    while apiserver.watch_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert apiserver.watch_count() == 0, "the watch connection must be closed"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_in_a_pod_discovery_uses_the_service_account_token_and_ca(apiserver, tmp_path, monkeypatch):
    """The in-cluster path: KUBERNETES_SERVICE_HOST/PORT, the mounted token and ca.crt, HTTPS."""
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube-apiserver",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    apiserver.stop()
    apiserver.start(tls=tls)
    token = tmp_path / "token"
    token.write_text(ROUTER_TOKEN)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(apiserver.port))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "must-not-be-read"))
    apiserver.apply(slice_of("llm-a", Endpoint("llm-0", "10.0.0.10")))

    async def scenario() -> None:
        reader = Reader(KubernetesDiscovery(*discovery_settings(), **FAST))
        try:
            await reader.until({"llm-0": "10.0.0.10:8080"})
        finally:
            await reader.close()

    asyncio.run(scenario())
    assert apiserver.url.startswith("https://")
    assert requests_of(apiserver, "list", 200), "listed with the ServiceAccount's token"


def test_without_credentials_discovery_fails_at_once_naming_the_cause(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))

    async def scenario() -> None:
        await anext(KubernetesDiscovery(*discovery_settings(), **FAST).snapshots())

    with pytest.raises(KubernetesCredentialsError, match="no usable credentials.*KUBECONFIG"):
        asyncio.run(asyncio.wait_for(scenario(), 10))
