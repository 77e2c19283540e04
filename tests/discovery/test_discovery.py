"""Static and file discovery: the protocol's snapshots, a watched file, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from extproc.discovery import SOURCES, ReplicaListError, checked_replicas, make_discovery
from extproc.discovery.file import FileDiscovery
from extproc.files import write_atomically
from extproc.settings import DiscoverySettings
from extproc.stack.processes import ROUTER_REFERENCE, free_port, service_env, static_discovery


def settings(**overrides: object) -> DiscoverySettings:
    base = {
        "source": "static",
        "static": {},
        "file": "",
        "file_poll_seconds": 0.01,
        "kubernetes_namespace": "n",
        "kubernetes_service": "s",
        "kubernetes_port_name": "http",
        "kubernetes_backoff_seconds": 1.0,
        "inference_pool": "",
        "leaving_seconds": 0.0,
        "leaving_near_seconds": 0.0,
    }
    return DiscoverySettings.model_validate(base | overrides)


@pytest.mark.parametrize("source", typing.get_args(DiscoverySettings.model_fields["source"].annotation))
def test_every_source_the_settings_accept_is_built_by_its_own_module(source: str) -> None:
    built = make_discovery(settings(source=source, static={"llm-0": "127.0.0.1:1"}, file="replicas.json",
                                    inference_pool="pool"))
    assert type(built).__module__ == SOURCES[source] and callable(built.snapshots)
    assert set(SOURCES) == set(typing.get_args(DiscoverySettings.model_fields["source"].annotation))


def test_static_yields_its_list_once() -> None:
    async def first() -> dict[str, str]:
        snapshots = make_discovery(settings(static={"llm-0": "127.0.0.1:1"})).snapshots()
        return await anext(snapshots)

    assert asyncio.run(first()) == {"llm-0": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([], "expected an object"),
        ({"": "1.2.3.4:5"}, "non-empty"),
        ({"a": "host:80"}, "ip:port"),
        ({"a": "1.2.3.4:0"}, "ip:port"),
        ({"a": 5}, "ip:port"),
    ],
)
def test_malformed_lists_are_refused_with_the_entry_named(raw: object, says: str) -> None:
    with pytest.raises(ReplicaListError, match=says):
        checked_replicas(raw, "discovery.static")


def test_file_discovery_follows_atomic_rewrites_and_keeps_the_last_good_list(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"

    def write(content: str) -> None:
        write_atomically(path, content)

    async def scenario() -> list[dict[str, str]]:
        seen: list[dict[str, str]] = []
        snapshots = FileDiscovery(path, 0.01).snapshots()
        seen.append(await anext(snapshots))  # no file yet: no replicas
        write(json.dumps({"llm-0": "127.0.0.1:1"}))
        seen.append(await anext(snapshots))
        write(json.dumps({"llm-0": "127.0.0.1:1", "llm-1": "127.0.0.1:2"}))
        seen.append(await anext(snapshots))
        write(json.dumps({"llm-1": "127.0.0.1:2"}))
        seen.append(await asyncio.wait_for(anext(snapshots), 2))
        await snapshots.aclose()
        return seen

    assert asyncio.run(scenario()) == [
        {},
        {"llm-0": "127.0.0.1:1"},
        {"llm-0": "127.0.0.1:1", "llm-1": "127.0.0.1:2"},
        {"llm-1": "127.0.0.1:2"},
    ]


def test_a_broken_file_keeps_the_last_good_list(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    path.write_text("{broken")
    good = {"llm-0": "127.0.0.1:1"}
    assert FileDiscovery(path, 1.0)._read(good) == good
    path.write_text(json.dumps({"llm-0": "nowhere"}))
    assert FileDiscovery(path, 1.0)._read(good) == good
    assert FileDiscovery(path, 1.0)._read(None) == {}


@pytest.mark.live
def test_the_service_exits_non_zero_when_discovery_fails(tmp_path: Path) -> None:
    """A supervisor (Kubernetes, the stack) must see that the service gave up."""
    discovery = static_discovery({"llm-0": "not-an-ip:80"})
    env = {**os.environ, **service_env(f"127.0.0.1:{free_port()}", tmp_path / "eds" / "replicas.json", discovery)}
    command = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(ROUTER_REFERENCE)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stdout + result.stderr
    events = [json.loads(line)["event"] for line in result.stdout.splitlines() if line.startswith("{")]
    assert events[-2:] == ["discovery_failed", "service_stopping"]
    assert "Traceback" not in result.stderr
