"""Start-up checks of the local stack that need no model: settings, ports, slot context,
the routing service's generated settings."""

from __future__ import annotations

import socket
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from extproc.cli import main as cli
from extproc.routing.replica_facts import ReplicaFacts
from extproc.settings import SettingsError, load_settings
from extproc.stack.errors import StackError
from extproc.stack.ports import PortInUse
from extproc.stack.processes import ROUTER_REFERENCE
from extproc.stack.replicas import ReplicaSettings, command
from extproc.stack.router import render_router_settings
from extproc.stack.settings import REFERENCE_SETTINGS, check_slot_context, load_stack_settings
from extproc.stack.stack import Stack
from extproc.stack.state import ServedModel, StackRun, StackState


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_reference_settings_load_and_options_override_them() -> None:
    settings = load_stack_settings(overrides={"replicas": {"count": 5, "model": None}})
    assert settings.replicas.count == 5
    assert settings.replicas.model == tomllib.loads(REFERENCE_SETTINGS.read_text())["replicas"]["model"]


def test_a_missing_setting_is_named(tmp_path: Path) -> None:
    text = REFERENCE_SETTINGS.read_text().replace("cache_ram_mib = 512\n", "")
    (tmp_path / "stack.toml").write_text(text)
    with pytest.raises(SettingsError, match=r"stack\.toml: replicas\.cache_ram_mib: missing"):
        load_stack_settings(tmp_path / "stack.toml")


def test_a_misspelt_stack_setting_stops_up_with_one_line_and_exit_2(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "stack.toml"
    settings.write_text(REFERENCE_SETTINGS.read_text().replace("\nthreads = 1\n", "\nthread = 1\n"))
    code = cli(["up", "--settings", str(settings), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"{settings}: replicas.thread: unknown setting (valid: count, backend," in err
    assert f"{settings}: replicas.threads: missing" in err
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_slot_context_too_small_for_the_profile_is_refused() -> None:
    small = ReplicaSettings("xllamacpp", "m.gguf", ctx_size=4096, parallel=4, threads=1, cache_ram_mib=0)
    with pytest.raises(StackError, match="max_context_tokens=3400 exceeds the replicas' per-slot context 1024"):
        check_slot_context("standard", small)
    check_slot_context("standard", ReplicaSettings("xllamacpp", "m.gguf", 16384, 4, 1, 0))


def test_router_settings_are_the_reference_with_this_stacks_addresses(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(render_router_settings(
        ROUTER_REFERENCE, policy="bounded", admin_listen="127.0.0.1:1234", metrics_listen="127.0.0.1:1235",
        replicas_file=tmp_path / "replicas.json", envoy_endpoints_file=tmp_path / "eds.json"))
    settings = load_settings(path, environ={})
    reference = load_settings(ROUTER_REFERENCE, environ={})
    assert settings.routing.policy == "bounded"
    assert settings.routing.params["bounded"] == reference.routing.params["bounded"]
    assert (settings.service.admin_listen, settings.service.metrics_listen) == ("127.0.0.1:1234", "127.0.0.1:1235")
    assert settings.service.listen == "" and settings.service.ext_proc_socket  # ext_proc on the socket alone
    assert settings.discovery.source == "file"
    assert settings.discovery.section.path == str(tmp_path / "replicas.json")
    assert settings.service.envoy_endpoints_file == str(tmp_path / "eds.json")
    assert settings.routing.params["llm-aware"] == reference.routing.params["llm-aware"]
    sized = tmp_path / "sized.toml"
    sized.write_text(render_router_settings(
        ROUTER_REFERENCE, policy="llm-aware", admin_listen="127.0.0.1:1234", metrics_listen="127.0.0.1:1235",
        replicas_file=tmp_path / "replicas.json", envoy_endpoints_file=tmp_path / "eds.json",
        replicas=ReplicaFacts(slots=2, cache_tokens=4096)))
    sized_all = load_settings(sized, environ={})
    assert sized_all.routing.replicas.cache_tokens == 4096  # what the replicas hold
    assert sized_all.routing.replicas.slots == 2  # their --parallel, one key for every reader


@pytest.mark.parametrize("port_key", ["gateway", "replica_base"])
def test_a_port_in_use_is_named_before_anything_starts(tmp_path: Path, busy_port: int, port_key: str) -> None:
    ports = {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0, port_key: busy_port}
    settings = load_stack_settings(overrides={"ports": ports, "replicas": {"model": "no-such-model"}})
    with pytest.raises(PortInUse, match=f"port {busy_port} .* already in use"):
        Stack.up(settings, tmp_path, tmp_path / "run", progress=lambda _: None)
    assert not (tmp_path / "run" / "state.json").exists()


def test_llm_ring_up_reports_the_busy_port(tmp_path: Path, busy_port: int,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    text = REFERENCE_SETTINGS.read_text().replace("gateway = 18000", f"gateway = {busy_port}")
    (tmp_path / "stack.toml").write_text(text)
    code = cli(["up", "--settings", str(tmp_path / "stack.toml"), "--run-dir", str(tmp_path / "run"),
                "--data-dir", str(tmp_path)])
    assert code == 1
    assert f"port {busy_port} (for the gateway (Envoy listener)) is already in use" in capsys.readouterr().err


def test_status_and_down_without_a_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["status", "--json", "--run-dir", str(tmp_path)]) == 1
    assert '"running": false' in capsys.readouterr().out
    assert cli(["down", "--run-dir", str(tmp_path)]) == 0


def test_the_written_router_settings_read_back_as_the_base_with_only_the_stacks_keys_changed(tmp_path: Path) -> None:
    endpoints = tmp_path / 'odd "name".json'  # quotes must be escaped
    written = render_router_settings(
        ROUTER_REFERENCE, policy="kv-cost", admin_listen="127.0.0.1:1234", metrics_listen="127.0.0.1:1235",
        replicas_file=tmp_path / "replicas.json", envoy_endpoints_file=endpoints,
        store_url="redis://llm-ring@127.0.0.1:9/0", store_password_file=tmp_path / "store" / "pw",
        replicas=ReplicaFacts(slots=2, cache_tokens=4096))
    expected = tomllib.loads(ROUTER_REFERENCE.read_text())
    expected["routing"]["policy"] = "kv-cost"
    expected["routing"]["replicas"] = {"slots": 2, "cache_tokens": 4096}
    expected["service"] |= {"listen": "", "admin_listen": "127.0.0.1:1234", "ext_proc_socket": "llm-ring-1234",
                            "metrics_listen": "127.0.0.1:1235", "envoy_endpoints_file": str(endpoints),
                            "routing_headers": True}
    expected["discovery"]["source"] = "file"
    expected["discovery"]["file"]["path"] = str(tmp_path / "replicas.json")
    expected["store"] |= {"url": "redis://llm-ring@127.0.0.1:9/0", "password_file": str(tmp_path / "store" / "pw")}
    assert written.startswith(f"# generated by `llm-ring up` from {ROUTER_REFERENCE}\n")
    assert tomllib.loads(written) == expected


def test_a_fleet_of_several_models_is_a_list_the_replicas_serve_in_turn(tmp_path: Path) -> None:
    fleet = load_stack_settings(overrides={"replicas": {"count": 4, "model": ["smollm2", "smollm2", "tiny"]}})
    assert fleet.replicas.models == ("smollm2", "smollm2", "tiny")
    assert load_stack_settings().replicas.models == ("smollm2",)
    with pytest.raises(SettingsError, match=r"replicas\.model: Value error, names no model"):
        load_stack_settings(overrides={"replicas": {"model": []}})
    served = [asdict(ServedModel(f"/m/{name}.gguf", name, name * 8, 1000)) for name in fleet.replicas.models]
    stack = StackRun(StackState(run_dir=str(tmp_path), gateway_url="", envoy_admin="", policy="llm-aware",
                                model="smollm2, smollm2, tiny", replica_settings=asdict(ReplicaSettings(
                                    "xllamacpp", "/m/smollm2.gguf", 4096, 2, 1, 0)),
                                replica_ports={}, replica_base=0, health_timeout=1.0, die_with_parent=False,
                                models=served))
    assert [stack.replica_settings(f"llm-{i}").alias for i in range(4)] == ["smollm2", "smollm2", "tiny", "smollm2"]
    assert stack.replica_settings("llm-2").model == "/m/tiny.gguf" and stack.replica_settings().alias == "smollm2"
    assert [model.alias for model in stack.served_models()] == ["smollm2", "tiny"]


def test_router_mode_needs_the_llama_server_backend() -> None:
    with pytest.raises(SettingsError, match=r"replicas: .*models_max: router mode needs backend = \"llama-server\""):
        load_stack_settings(overrides={"replicas": {"models_max": 1, "backend": "xllamacpp"}})
    settings = load_stack_settings(overrides={"replicas": {"models_max": 1, "backend": "llama-server"}})
    assert settings.replicas.models_max == 1


def test_a_router_mode_replica_serves_a_folder_of_models(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    one = ReplicaSettings("llama-server", "/m/smollm2.gguf", 4096, 2, 1, 0, llama_server=str(binary))
    line = command(one, 9000, tmp_path, tmp_path / "key")
    assert line[line.index("--model") + 1] == "/m/smollm2.gguf" and "--models-dir" not in line
    routed = command(replace(one, models_dir=str(tmp_path / "models"), models_max=1), 9000, tmp_path, tmp_path / "k")
    assert "--model" not in routed and "--alias" not in routed
    assert routed[routed.index("--models-dir") + 1:routed.index("--models-max") + 2] == [
        str(tmp_path / "models"), "--models-max", "1"]
