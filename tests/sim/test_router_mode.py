"""llama.cpp's router mode in the simulator: loads, waits, LRU unloads and their cache, reports to the router."""

from __future__ import annotations

import json

import pytest

from extproc.cli import main
from extproc.records import read_run_metadata
from extproc.routing import Router
from extproc.sim.engine import Fleet, OpenLoop, simulate
from extproc.sim.router_mode import RouterMode
from extproc.sim.workload import name_model
from tests.sim.helpers import request, settings, simple_cost

LOAD_S = {"a": 1.0, "b": 1.0}


def run(*sent, models_max=1, slots=1, cache_tokens=0, lag_s=0.0):  # noqa: ANN202
    """(model, request) pairs through one router-mode replica."""
    for model, item in sent:
        name_model(item, model)
    router = Router(settings("round-robin").model_copy(update={"prior_model_load_ms": 1500.0}))
    fleet = Fleet(1, slots, cache_tokens, router_mode=RouterMode({"a": 1, "b": 1}, LOAD_S, models_max, lag_s))
    outcome = simulate(OpenLoop([item for _, item in sent]), router, simple_cost(), fleet)
    return {r.request_id: r for r in outcome.requests}, outcome, router


def test_a_request_waits_for_its_model_load_and_the_router_hears_of_it():
    done, outcome, router = run(("a", request("r1", "x", 1, 100, 10, 0.0)), lag_s=0.005)
    r1 = done["r1"]
    assert (r1.started_at, r1.first_token_at, r1.finished_at) == pytest.approx((1.0, 2.0, 3.0))  # load 0-1 s
    assert outcome.loads == {"llm-0": 1}
    assert router.residency.statuses("llm-0") == {"b": "unloaded", "a": "loaded"}
    assert router.residency.load_s == pytest.approx(1.5 + 0.3 * (1.0 - 1.5))  # learnt from the prior 1.5 s


@pytest.mark.parametrize(("models_max", "loads", "cached"), [(1, 3, 0), (2, 2, 110)])
def test_at_models_max_the_lru_idle_model_is_unloaded_with_its_cache(models_max, loads, cached):
    # one slot, host-RAM cache: x's 110 tokens go to host RAM when y takes the slot; b's load
    # unloads a (models_max 1), and x's next turn finds nothing of it; with room for both, it does
    done, outcome, _ = run(
        ("a", request("x1", "x", 1, 100, 10, 0.0)), ("a", request("y1", "y", 1, 100, 10, 3.5)),
        ("b", request("z1", "z", 1, 50, 5, 6.0)), ("a", request("x2", "x", 2, 140, 10, 9.0)),
        models_max=models_max, cache_tokens=1000)
    assert outcome.loads == {"llm-0": loads}
    assert done["x2"].cache_n == cached
    assert done["x2"].started_at == pytest.approx(10.0 if models_max == 1 else 9.0)  # a loaded again, or still


def test_a_model_with_a_request_running_is_not_unloaded():
    # a's request runs 1-3 s; b's request at 1.5 s waits for it to end, then for b's load (3-4 s)
    done, outcome, router = run(("a", request("r1", "x", 1, 100, 10, 0.0)), ("b", request("r2", "y", 1, 50, 5, 1.5)),
                                slots=2)
    assert (done["r1"].first_token_at, done["r1"].finished_at) == pytest.approx((2.0, 3.0))
    assert done["r2"].started_at == pytest.approx(4.0)
    assert outcome.loads == {"llm-0": 2}
    assert router.residency.statuses("llm-0") == {"a": "unloaded", "b": "loaded"}


def _loads(tmp_path, capsys, policies, seeds):  # noqa: ANN202
    out = tmp_path / "out"
    assert main(["sim", "--profile", "standard", "--models", "smollm2:0.5,tiny:0.5", "--models-max", "1",
                 "--replicas", "4", "--policies", *policies, "--seeds", seeds, "--out-dir", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["model_loads"]["4"], out


def test_loads_are_counted_per_run_and_replica(tmp_path, capsys):
    table, out = _loads(tmp_path, capsys, ["bounded"], "1")
    extra = read_run_metadata(next(out.glob("sim-*"))).extra
    assert extra["model_loads"] == sum(extra["model_loads_by_replica"].values()) > 0
    assert set(extra["model_loads_by_replica"]) == {"llm-0", "llm-1", "llm-2", "llm-3"}
    assert table["bounded"]["model_loads"][0] == extra["model_loads"]


def test_llm_aware_loads_fewer_models_than_bounded(tmp_path, capsys):
    table, _ = _loads(tmp_path, capsys, ["llm-aware", "bounded"], "1-3")
    assert table["llm-aware"]["model_loads"][0] < table["bounded"]["model_loads"][0]
