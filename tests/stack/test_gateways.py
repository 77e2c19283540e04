"""Several gateways on the local stack, without starting any: the port layout, start-up
refusals, the front Envoy's configuration, [store] url in each router's settings, the
supervisor leaving a killed gateway down, and `llm-ring run --kill-gateway`'s drill."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.cli import main as cli
from extproc.envoy.front import render_front_config
from extproc.experiments.run import Kill, Killer, failures
from extproc.records import RunMeta, write_records
from extproc.stack import supervisor
from extproc.stack.daemons import Daemon
from extproc.stack.errors import StackError
from extproc.stack.gateways import PORTS_PER_GATEWAY, layout, port_purposes
from extproc.stack.processes import ROUTER_REFERENCE, envoy_binary
from extproc.stack.redis_server import ADMIN, password_file, redis_command, router_rule, write_config
from extproc.stack.router import render_router_settings
from extproc.stack.settings import load_stack_settings
from extproc.stack.stack import Stack
from extproc.stack.state import StackState
from extproc.stack.supervisor import supervise_once

FREE = {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0, "gateway_base": 0, "store": 0}


def test_one_gateway_is_the_stack_as_it_was(tmp_path: Path) -> None:
    (gw,) = layout(1, tmp_path, (18000, 18001, 18002, 18003), 18010, [])
    assert (gw.router_name, gw.envoy_name, gw.files) == ("router", "envoy", str(tmp_path))
    assert (gw.listen, gw.envoy_admin, gw.router_address) == ("127.0.0.1:18000", "127.0.0.1:18001", "127.0.0.1:18002")
    assert gw.metrics_url == "http://127.0.0.1:18003/metrics"
    assert load_stack_settings().gateways.count == 1  # the reference: one gateway


@given(count=st.integers(2, 16), base=st.integers(1024, 60000))
def test_several_gateways_take_four_ports_each_from_the_base(count: int, base: int) -> None:
    gateways = layout(count, Path("/run"), (1, 2, 3, 4), base, [])
    ports = [port for port, _ in port_purposes(gateways)]
    assert sorted(ports) == list(range(base, base + PORTS_PER_GATEWAY * count))
    assert [g.name for g in gateways] == [f"gw-{i}" for i in range(count)]
    assert len({g.files for g in gateways}) == count and len({g.router_name for g in gateways}) == count


def test_free_gateway_ports_come_from_the_spare_ones() -> None:
    spare = list(range(30000, 30008))
    gateways = layout(2, Path("/run"), (1, 2, 3, 4), 0, spare)
    assert sorted(port for port, _ in port_purposes(gateways)) == list(range(30000, 30008)) and spare == []


def _settings(**gateways: Any) -> Any:
    return {"ports": FREE, "replicas": {"model": "no-such-model"}, "gateways": gateways}


def test_overlapping_port_ranges_are_refused_naming_the_port(tmp_path: Path) -> None:
    overrides = _settings(count=2, redis_server="/bin/true")
    overrides["ports"] = FREE | {"gateway_base": 31000, "replica_base": 31004}
    with pytest.raises(StackError, match="port 31004 is both for .* of gw-1 and for replica llm-0"):
        Stack.up(load_stack_settings(overrides=overrides), tmp_path, tmp_path / "run", progress=lambda _: None)
    assert not (tmp_path / "run").exists()


def test_several_gateways_without_redis_are_refused_one_gateway_needs_none(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"\[gateways\] redis_server: no-such-redis not found"):
        Stack.up(load_stack_settings(overrides=_settings(count=2, redis_server="no-such-redis")), tmp_path,
                 tmp_path / "run", progress=lambda _: None)
    with pytest.raises(Exception, match="no-such-model"):  # got past the gateways: the model is next
        Stack.up(load_stack_settings(overrides=_settings(count=1, redis_server="no-such-redis")), tmp_path,
                 tmp_path / "run", progress=lambda _: None)


def test_the_gateway_count_is_bounded_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["up", "--gateways", "0", "--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path)]) == 2
    assert "gateways.count: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_each_router_gets_the_store_url_with_several_gateways(tmp_path: Path) -> None:
    common = {"policy": "llm-aware", "admin_listen": "127.0.0.1:1", "metrics_listen": "127.0.0.1:2",
              "replicas_file": tmp_path / "r.json", "envoy_endpoints_file": tmp_path / "e.json"}
    rendered = tomllib.loads(render_router_settings(ROUTER_REFERENCE, store_url="redis://127.0.0.1:9/0", **common))
    assert rendered["store"]["url"] == "redis://127.0.0.1:9/0"
    assert tomllib.loads(render_router_settings(ROUTER_REFERENCE, **common))["store"]["url"] == ""  # one gateway


def test_the_store_keeps_nothing_on_disk_listens_on_loopback_and_wants_a_password(tmp_path: Path) -> None:
    config = write_config(6400, tmp_path)
    command = redis_command("/usr/bin/redis-server", config)
    assert command == ["/usr/bin/redis-server", str(config)]  # no option, no password on the command line
    lines = config.read_text().splitlines()
    options = dict(line.split(" ", 1) for line in lines if not line.startswith("user "))
    assert options == {"port": "6400", "bind": "127.0.0.1", "protected-mode": "yes", "dir": str(tmp_path),
                       "save": '""', "appendonly": "no", "maxmemory": "256mb", "maxmemory-policy": "volatile-ttl",
                       "daemonize": "no"}
    password = password_file(tmp_path).read_text().strip()
    assert "user default off" in lines and len(password) >= 32
    assert f"user llm-ring on >{password} {router_rule('llm-ring')}" in lines
    for private in (config, password_file(tmp_path), password_file(tmp_path, ADMIN)):
        assert private.stat().st_mode & 0o777 == 0o600, private
    assert write_config(6400, tmp_path).read_text() == config.read_text()  # a restart: the same passwords


def front(gateways: int = 2) -> dict[str, Any]:
    pairs = [(f"127.0.0.1:{20000 + 4 * i}", f"127.0.0.1:{20001 + 4 * i}") for i in range(gateways)]
    return json.loads(render_front_config(listen="127.0.0.1:19990", admin="127.0.0.1:19991", gateways=pairs))


@pytest.mark.parametrize("gateways", [2, 3])
def test_the_front_spreads_connections_at_random_and_retries_another_gateway(gateways: int) -> None:
    config = front(gateways)
    (listener,) = config["static_resources"]["listeners"]
    (proxy,) = listener["filter_chains"][0]["filters"]
    assert proxy["name"] == "envoy.filters.network.tcp_proxy"  # connection level: HTTP is not read
    assert proxy["typed_config"]["max_connect_attempts"] > gateways  # every gateway can be tried
    assert proxy["typed_config"]["backoff_options"]["base_interval"]  # the ejection has time to reach the draws
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "RANDOM" and cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    # each gateway is health-checked on its Envoy admin's /ready, traffic goes to its listener
    ports = [(e["endpoint"]["address"]["socket_address"]["port_value"],
              e["endpoint"]["health_check_config"]["port_value"]) for e in endpoints]
    assert ports == [(20000 + 4 * i, 20001 + 4 * i) for i in range(gateways)]
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/ready"
    outlier = cluster["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] and outlier["consecutive_local_origin_failure"] == 1
    assert outlier["max_ejection_percent"] == 100


@pytest.mark.live
def test_envoy_validates_the_front(tmp_path: Path) -> None:
    path = tmp_path / "front.yaml"
    path.write_text(json.dumps(front(3)))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_supervisor_leaves_a_gateway_held_down_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = {"pid": 1, "started": 0.0, "log": ""}  # pid 1 was not started at time 0: not alive
    gateways = [gw.__dict__ | {"router": dead, "envoy": dead} for gw in layout(2, tmp_path, (1, 2, 3, 4), 31000, [])]
    state = StackState(run_dir=str(tmp_path), gateway_url="", envoy_admin="", policy="llm-aware", model="tiny",
                       replica_settings={}, replica_ports={}, replica_base=0, health_timeout=1.0,
                       die_with_parent=False, gateways=gateways, front=dead, store=dead,
                       held_down=["router-1", "envoy-1"])
    stack = Stack(state)
    stack.save()
    assert not Daemon(**dead).alive()
    restarted: list[str] = []
    monkeypatch.setattr(supervisor, "restart", lambda _, name: restarted.append(name))
    supervise_once(stack, 0.0, [])
    assert sorted(restarted) == ["envoy-0", "front", "router-0", "store"]


class FakeTier:
    """A lab with two gateways that notes what is done to it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.restarted = threading.Event()

    def routers(self) -> dict[str, str]:
        return {"gw-0": "a:1", "gw-1": "b:1"}

    def kill_part(self, name: str) -> float:
        self.calls.append(f"kill {name}")
        return time.time()

    def restart_part(self, name: str) -> None:
        self.calls.append(f"restart {name}")
        self.restarted.set()

    def router_states(self) -> dict[str, dict[str, int]]:
        return {}


def meta() -> RunMeta:
    return RunMeta(run_id="r", policy="p", seed=1, simulated=False, profile={}, routing={}, replicas_start=2,
                   started_at="")


def test_the_drill_kills_then_restarts_and_records_both() -> None:
    lab = FakeTier()
    killer = Killer(lab, "gw-1", Kill(at_s=0.0, restart_after_s=0.0))
    killer.start()
    assert lab.restarted.wait(30)
    killer.join()
    run = meta()
    killer.record(run)
    assert lab.calls == ["kill gw-1", "restart gw-1"]
    kill = run.extra["kill"]
    assert kill["name"] == "gw-1" and kill["killed_after_s"] >= 0 and kill["down_s"] >= 0 and "error" not in kill


def test_a_run_that_ends_before_the_kill_kills_nothing() -> None:
    lab = FakeTier()
    killer = Killer(lab, "gw-1", Kill(at_s=3600.0, restart_after_s=5.0))
    killer.start()
    killer.join()
    run = meta()
    killer.record(run)
    assert lab.calls == [] and run.extra["kill"]["killed_at"] is None


@pytest.mark.parametrize("options, message", [
    (["--kill-gateway", "0"], "--kill-gateway must be > 0 seconds (got 0)"),
    (["--kill-gateway", "nan"], "--kill-gateway must be > 0 seconds (got nan)"),
    (["--kill-gateway", "5", "--restart-after", "-1"], "--restart-after must be >= 0 seconds (got -1)"),
    (["--kill-gateway", "5"], "--kill-gateway needs a lab with 2 or more gateways (this one has 1"),
    (["--kill-store", "0"], "--kill-store must be > 0 seconds (got 0)"),
    (["--kill-store", "5"], "--kill-store needs a lab with 2 or more gateways (this one has 1"),
    (["--kill-store", "5", "--kill-gateway", "5"], "--kill-gateway and --kill-store: one drill a run"),
])
def test_bad_kill_options_stop_the_run_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     options: list[str], message: str) -> None:
    code = cli(["run", "--profile", "quick", "--policies", "bounded", "--seeds", "1", "--out-dir", str(tmp_path / "o"),
                "--gateway", "http://127.0.0.1:1", "--admin", "127.0.0.1:1", *options])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def test_failed_requests_are_told_apart_by_when_they_ran_against_the_kill(tmp_path: Path) -> None:
    def row(started: float, finished: float, status: int, error: str | None) -> dict[str, Any]:
        return {"run_id": "r", "policy": "p", "seed": 1, "simulated": False, "conversation": "c", "turn": 1,
                "status": status, "error": error, "started_at": started, "finished_at": finished}

    write_records([
        row(90.0, 95.0, 0, "ConnectionError"),  # failed before the kill: not the kill's
        row(98.0, 100.5, 200, "ChunkedEncodingError"),  # cut by the kill at 100
        row(99.0, 101.0, 0, "RemoteDisconnected"),  # cut by the kill
        row(100.01, 100.02, 0, "ConnectionResetError"),  # sent after it
        row(99.0, 102.0, 200, None),  # in flight, and fine
    ], tmp_path / "requests.parquet")
    assert failures(tmp_path, 100.0) == {"failed": 4, "failed_in_flight_at_kill": 2, "failed_started_after_kill": 1}
    assert failures(tmp_path, None) == {"failed": 4}


def test_a_state_file_from_before_several_gateways_is_named_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = {"run_dir": str(tmp_path), "gateway_url": "http://127.0.0.1:18000", "metrics_url": "",
           "router_address": "127.0.0.1:18002", "envoy_admin": "", "policy": "llm-aware", "model": "tiny"}
    (tmp_path / "state.json").write_text(json.dumps(old))
    assert cli(["status", "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "state.json is not a state file of this llm-ring" in err, err
