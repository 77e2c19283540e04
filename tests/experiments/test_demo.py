"""The demo's simulated half and its verdict (the live half is the runner, tested in test_run.py)."""

from __future__ import annotations

import pytest
from analysis.fixtures import make_experiment
from hypothesis import given
from hypothesis import strategies as st

from extproc.analysis.report import build_report, combine
from extproc.experiments.demo import VERDICT_METRICS, pictures, prediction_line, simulate, verdict


def paired(**metrics: tuple[float, float]) -> dict:
    return {"llm-aware - bounded": {
        name: {"mean": mean, "ci95": ci, "n_runs": 20} for name, (mean, ci) in metrics.items()
    }}


def test_a_difference_whose_interval_includes_zero_is_called_noise():
    text = verdict("quick", paired(hit_rate=(-0.015, 0.054), redirects=(0.0, 1.5),
                                   latency_p50=(0.118, 0.122), latency_p95=(-0.991, 0.480)))
    assert text.startswith("quick, llm-aware - bounded paired by seed: ")
    assert "cache hit rate (follow-up turns) within noise (-1.5% ± 5.4%, the interval includes 0)" in text
    assert "redirects per run within noise" in text and "p50 latency within noise" in text
    assert "p95 latency lower (-0.991 s ± 0.480 s)" in text
    assert text.count("\n") == 0  # one sentence per comparison


def test_the_live_prediction_share_is_pooled_over_each_policys_runs():
    runs = [{"policy": "bounded", "predictions": 30, "predictions_within_10": 3},
            {"policy": "llm-aware", "predictions": 34, "predictions_within_10": 34},
            {"policy": "llm-aware", "predictions": 33, "predictions_within_10": 31},
            {"policy": "round-robin", "predictions": 0, "predictions_within_10": None}]
    assert prediction_line(runs) == ("live predictions within 10 % of the prompt (|predicted - cache_n|): "
                                     "bounded 10.0 % (3/30), llm-aware 97.0 % (65/67), round-robin -")


@given(st.floats(-100, 100, allow_nan=False), st.floats(0, 100, allow_nan=False))
def test_noise_exactly_when_the_interval_holds_zero(mean, ci):
    text = verdict("p", paired(**{name: (mean, ci) for name in VERDICT_METRICS}))
    assert text.count("within noise") == (len(VERDICT_METRICS) if abs(mean) <= ci else 0)


@pytest.mark.parametrize("profile, replicas", [("quick", 2), ("busy", 3)])
def test_simulated_half_writes_a_folder_and_pairs_by_seed(tmp_path, profile, replicas):
    differences = simulate(profile, ["bounded", "llm-aware"], [1, 2, 3], replicas, 2, tmp_path / "sim")
    assert (tmp_path / "sim" / "summary.md").exists()
    assert len([p for p in (tmp_path / "sim").iterdir() if p.is_dir()]) == 6
    assert differences["llm-aware - bounded"]["hit_rate"]["n_runs"] == 3
    assert "paired by seed" in verdict(profile, differences)


def test_the_demo_writes_the_charts_and_html_report_of_its_live_and_simulated_folders(tmp_path):
    live, same = make_experiment(tmp_path / "live"), tmp_path / "sim"
    simulate("quick", ["bounded", "llm-aware"], [1, 2], 2, 2, same)
    charts, page = pictures(live, same, combine([live, same], [build_report(live), build_report(same)]), tmp_path)
    assert (charts / "summary.png").exists() and (charts / "hit_rate_over_time.svg").exists()
    assert f"llm-ring report {live} {same} --charts {charts} --html {page}" in page.read_text()


@pytest.mark.parametrize("model", ["smollm2", ""])
def test_the_simulated_first_turns_go_to_the_ring_home_the_service_gives_the_named_model(tmp_path, model):
    """The service keys a conversation under the model its requests name (continuation.of_model);
    simulated with that model, each unhurried first turn lands on the same ring home, as the
    live run placed it."""
    import duckdb

    from extproc.routing import Router
    from extproc.routing.continuation import of_model
    from extproc.sim.runs import load_sim_config, parse_policy

    simulate("quick", ["bounded"], [1], 2, 2, tmp_path / "sim", model)
    router = Router(parse_policy("bounded", load_sim_config().routing))
    router.set_replicas(["llm-0", "llm-1"])
    served = duckdb.sql(f"SELECT conversation, replica FROM read_parquet('{tmp_path}/sim/*/requests.parquet') "
                        "WHERE turn = 1 AND route_reason = 'home'").fetchall()
    assert len(served) >= 6
    homes = {name: router.ring.home(router.conversation_key(of_model("smollm2", name))) for name, _ in served}
    agree = sum(homes[name] == replica for name, replica in served)
    assert (agree == len(served)) == (model == "smollm2"), (agree, len(served))
