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

from extproc.discovery import ReplicaListError, checked_replicas
from extproc.discovery.file import FileDiscovery
from extproc.discovery.plugin import REGISTRY, make_discovery
from extproc.files import write_atomically
from extproc.settings import DiscoverySettings, Settings, SettingsError, parse_settings, read_toml
from extproc.stack.processes import ROUTER_REFERENCE, free_port, service_env, static_discovery


def settings(source: str = "static", **sections: dict[str, object]) -> DiscoverySettings:
    base: dict[str, object] = {
        "source": source,
        "leaving_seconds": 0.0,
        "leaving_near_seconds": 0.0,
        "static": {"replicas": {}},
        "file": {"path": "", "poll_seconds": 0.01},
        "kubernetes": {"namespace": "n", "service": "s", "port_name": "http", "backoff_seconds": 1.0},
        "inference-pool": {"namespace": "n", "name": "pool", "backoff_seconds": 1.0},
    }
    return DiscoverySettings.model_validate(base | sections)


@pytest.mark.parametrize("source", list(REGISTRY))
def test_every_registered_source_is_built_by_its_own_module_from_its_own_section(source: str) -> None:
    built = make_discovery(settings(source, static={"replicas": {"llm-0": "127.0.0.1:1"}}))
    assert type(built).__module__ == REGISTRY[source] and callable(built.snapshots)


def reference_with(change: typing.Callable[[dict[str, typing.Any]], None]) -> str:
    """What start-up says of the reference settings changed by ``change`` ("" when they pass)."""
    raw = read_toml(ROUTER_REFERENCE)
    change(raw["discovery"])
    try:
        parse_settings(raw, "router.toml")
    except SettingsError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d.update(source="consul"),
         "router.toml: discovery.source: Input should be 'static', 'file', 'kubernetes' or 'inference-pool' "
         "(got 'consul')"),
        (lambda d: d.update(kubernetes_service="llm"),  # a source's key among the shared ones
         "router.toml: discovery.kubernetes_service: unknown setting (valid: source, leaving_seconds, "
         "leaving_near_seconds, static, file, kubernetes, inference-pool)"),
        (lambda d: d["file"].update(service="llm"),  # another source's key
         "router.toml: discovery.file.service: unknown setting (valid: path, poll_seconds)"),
        (lambda d: d["kubernetes"].update(backoff_seconds=0),
         "router.toml: discovery.kubernetes.backoff_seconds: Input should be greater than 0 (got 0)"),
        (lambda d: d.update(leaving_seconds=-1), "router.toml: discovery.leaving_seconds: Input should be greater"),
        (lambda d: d["file"].pop("path"), "router.toml: discovery.file.path: missing"),
    ],
)
def test_a_key_in_the_wrong_place_or_an_unknown_source_is_refused_by_name(change: typing.Any, says: str) -> None:
    said = reference_with(change)
    assert said.startswith(says) and "; router.toml" not in said, said  # one problem, one line


def test_the_chosen_source_needs_its_section_and_every_section_given_is_checked() -> None:
    def only_static(discovery: dict[str, typing.Any]) -> None:
        for name in ("file", "kubernetes", "inference-pool"):
            del discovery[name]
        discovery["source"] = "static"

    assert reference_with(only_static) == ""
    assert reference_with(lambda d: d.pop("file")) == (
        "router.toml: discovery.file.path: missing (every setting must be given; there are no defaults); "
        "router.toml: discovery.file.poll_seconds: missing (every setting must be given; there are no defaults)")
    said = reference_with(lambda d: d["inference-pool"].update(pool="llm"))  # not chosen, still checked
    assert said.startswith("router.toml: discovery.inference-pool.pool: unknown setting (valid: namespace, "
                           "backoff_seconds, name)"), said


def test_llm_ring_serve_stops_with_exit_code_2_and_one_line_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    config = tmp_path / "router.toml"
    config.write_text(ROUTER_REFERENCE.read_text().replace('source = "file"', 'source = "file"\nfile_poll_seconds = 1'))
    assert main(["serve", "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"llm-ring serve: {config}: discovery.file_poll_seconds: unknown setting"), line


def test_the_settings_hold_the_chosen_source_s_section() -> None:
    chosen = parse_settings(read_toml(ROUTER_REFERENCE)).discovery
    assert (chosen.source, chosen.section.path) == ("file", ".llm-ring/replicas.json")
    assert Settings.model_fields["discovery"].annotation is DiscoverySettings


def test_static_yields_its_list_once() -> None:
    async def first() -> dict[str, str]:
        snapshots = make_discovery(settings(static={"replicas": {"llm-0": "127.0.0.1:1"}})).snapshots()
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
