"""A policy added from outside: tests/routing/toy_policy.py and one register line, then run
through the Router, the simulator and `llm-ring sim --policies toy:max_in_flight=...`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.records import read_records
from extproc.routing import Router, RouteRequest, reasons, render_trace
from extproc.routing.policies import register
from extproc.routing.policies.plugin import unregister
from extproc.settings import SettingsError
from extproc.sim.engine import Fleet
from extproc.sim.runs import load_sim_config, parse_policy, run_once
from extproc.sim.workload import profile_workload
from extproc.traffic import load_profile
from tests.routing import toy_policy
from tests.routing.conftest import key_with_walk, routing
from tests.sim.helpers import simple_cost


@pytest.fixture
def toy() -> Iterator[None]:
    register(toy_policy.PLUGIN)  # the one registry line
    yield
    unregister("toy")


def test_the_router_runs_it_with_its_parameter_reasons_and_details(toy: None) -> None:
    router = Router(routing(policy="toy", max_in_flight=2), ["llm-0", "llm-1", "llm-2"])
    key = key_with_walk(router, "llm-1")
    picks = [router.route(RouteRequest(str(n), key, 100, 10)).decision for n in range(3)]
    assert [(d.replica, d.reason) for d in picks if d] == [("llm-1", "toy-home"), ("llm-1", "toy-home"),
                                                          ("llm-0", "toy-spill")]
    third = picks[2]
    assert third is not None and third.trace.as_dict() == {
        "policy": "toy", "prompt_tokens": 100, "max_tokens": 10, "cached_tokens": 0,
        "home": "llm-1", "home_in_flight": 2, "max_in_flight": 2}
    assert render_trace(third).splitlines() == ["toy → llm-0 (toy-spill)",
                                                "  home=llm-1 home_in_flight=2 max_in_flight=2"]
    assert {"toy-home", "toy-spill"} <= set(reasons())
    router.complete("0")
    assert router.route(RouteRequest("3", key, 100, 10)).decision.reason == "toy-home"  # type: ignore[union-attr]


def test_its_section_is_checked_like_any_policy_s(toy: None) -> None:
    base = load_sim_config().routing  # sim.toml has no [routing.toy]: the spec must give its key
    with pytest.raises(SettingsError, match=r"policy 'toy': routing\.toy\.max_in_flight: missing"):
        parse_policy("toy", base)
    with pytest.raises(SettingsError, match=r"toy\.max_in_flight: Input should be greater than 0"):
        parse_policy("toy:max_in_flight=0", base)
    with pytest.raises(SettingsError, match=r"unknown setting epsilon \(valid: max_in_flight, virtual_nodes"):
        parse_policy("toy:epsilon=0.5", base)
    assert parse_policy("toy:max_in_flight=3", base).params["toy"].max_in_flight == 3


def test_the_simulator_runs_it(toy: None) -> None:
    settings = parse_policy("toy:max_in_flight=1", load_sim_config().routing)
    fleet = Fleet(replicas=3, slots=4, cache_tokens=0)
    outcome = run_once(profile_workload(load_profile("quick"), 1), settings, simple_cost(), fleet)
    found = {request.reason for request in outcome.requests}
    assert found == {"toy-home", "toy-spill"}, found


def test_llm_ring_sim_runs_it(toy: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["sim", "--profile", "quick", "--policies", "toy:max_in_flight=1", "--seeds", "1",
                 "--replicas", "2", "--out-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    (run,) = (path for path in out.iterdir() if path.is_dir())
    assert run.name == "sim-quick-r2-toy_max_in_flight=1-s1"
    assert set(read_records(run / "requests.parquet").column("route_reason").to_pylist()) == {"toy-home", "toy-spill"}
    assert json.loads((run / "run.json").read_text())["routing"]["max_in_flight"] == 1
