import pytest

from analysis.fixtures import known_run, make_experiment, request, write_run
from extproc.analysis.metrics import (
    connect,
    hit_rate_over_time,
    latency_quantiles,
    per_run,
    route_reasons,
    summary,
)


def one_run(tmp_path, rows=None, **kw):
    write_run(tmp_path, "bounded-s1", "bounded", 1, rows or known_run(), **kw)
    return connect(tmp_path)


def test_hits_misses_avoidable_and_redirects(tmp_path):
    (run,) = per_run(one_run(tmp_path))
    assert (run["requests"], run["errors"], run["followups"]) == (8, 1, 4)
    assert (run["hits"], run["misses"], run["avoidable_misses"], run["redirects"]) == (2, 2, 1, 1)
    assert run["hit_rate"] == 0.5 and run["avoidable_share"] == 0.5


def test_work_imbalance_is_busiest_over_average_prompt_tokens(tmp_path):
    (run,) = per_run(one_run(tmp_path))
    # ok requests only: llm-0 = 100 + 30 = 130, llm-1 = 160 + 20 + 50 + 70 + 10 = 310
    assert run["imbalance"] == pytest.approx(310 / 220)


def test_latency_quantiles_are_continuous_over_ok_requests(tmp_path):
    (run,) = per_run(one_run(tmp_path))
    # ok latencies 1..7 (the 0.1 s error is excluded): p50 = 4, p95 = 6 + 0.7 * (7 - 6)
    assert run["latency_p50"] == 4.0 and run["latency_p95"] == pytest.approx(6.7)


def test_hit_share_sets_the_hit_threshold(tmp_path):
    one_run(tmp_path)
    # c1 turn 2 reused 100 of the previous 100 tokens, c1 turn 4 160 of 165: both hit at 0.96
    (run,) = per_run(connect(tmp_path, hit_share=0.96))
    assert run["hits"] == 2
    (run,) = per_run(connect(tmp_path, hit_share=1.0))
    assert run["hits"] == 1
    with pytest.raises(ValueError, match="hit_share"):
        connect(tmp_path, hit_share=0)


def test_scale_up_hit_rate_and_movement(tmp_path):
    r = lambda *a, **k: request("bounded-s1", "bounded", 1, *a, **k)  # noqa: E731
    rows = [
        r("a", 1, "llm-0", 0, 100, at=0), r("a", 2, "llm-0", 100, 20, at=20),  # stays, hit
        r("b", 1, "llm-1", 0, 100, at=0), r("b", 2, "llm-2", 3, 117, at=20),  # moved, miss
        r("b", 3, "llm-2", 120, 20, at=30),  # second turn after the scale-up: not counted
        r("c", 1, "llm-1", 0, 100, at=5), r("c", 2, "llm-1", 100, 20, at=8),  # all before
        r("d", 1, "llm-2", 0, 100, at=15), r("d", 2, "llm-2", 100, 20, at=18),  # all after
    ]  # fmt: skip
    (run,) = per_run(one_run(tmp_path, rows, scale_ready_s=10.0))
    assert run["after_scale_turns"] == 2
    assert run["after_scale_hit_rate"] == 0.5 and run["moved_share"] == 0.5


def test_no_scale_up_gives_no_scale_metrics(tmp_path):
    (run,) = per_run(one_run(tmp_path))
    assert run["after_scale_turns"] == 0 and run["moved_share"] is None


def test_pooled_over_seeds_with_spread(tmp_path):
    r2 = [
        request("bounded-s2", "bounded", 2, "x", 1, "llm-0", 0, 100, at=0),
        request("bounded-s2", "bounded", 2, "x", 2, "llm-0", 100, 10, at=1),  # hit
    ]
    write_run(tmp_path, "bounded-s1", "bounded", 1, known_run())
    write_run(tmp_path, "bounded-s2", "bounded", 2, r2)
    hit = summary(connect(tmp_path))["bounded"]["hit_rate"]
    assert hit["value"] == pytest.approx(3 / 5)  # pooled counts, not the mean of 0.5 and 1.0
    assert (hit["min"], hit["max"], hit["mean"], hit["n_runs"]) == (0.5, 1.0, 0.75, 2)
    assert hit["ci95"] == pytest.approx(12.706 * 0.5 / 2**0.5 / 2**0.5)
    assert summary(connect(tmp_path))["bounded"]["errors"]["value"] == 0.5  # mean per run


def test_chart_queries_stay_small(tmp_path):
    con = connect(make_experiment(tmp_path))
    over_time = hit_rate_over_time(con, bin_s=5)
    assert {row["policy"] for row in over_time} == {"bounded", "llm-aware"}
    assert all(0 <= row["hit_rate"] <= 1 for row in over_time)
    cdf = latency_quantiles(con)
    assert len(cdf) == 2 * 99 and cdf[0]["percentile"] == 1
    assert sum(row["per_run"] for row in route_reasons(con) if row["policy"] == "bounded") == 72
    pooled = summary(con)
    assert pooled["llm-aware"]["hit_rate"]["value"] > pooled["bounded"]["hit_rate"]["value"]


def test_folder_without_records_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*/requests.parquet"):
        connect(tmp_path)


def test_prediction_error_is_the_mean_absolute_error_and_the_share_within_a_tenth_of_the_prompt(tmp_path):
    r = lambda *a, predicted, **k: {**request(*a, **k), "predicted_cached_tokens": predicted}  # noqa: E731
    first = [r("p-s1", "p", 1, "a", 1, "llm-0", 0, 100, at=0, predicted=0),  # exact
             r("p-s1", "p", 1, "a", 2, "llm-0", 90, 30, at=2, predicted=100),  # off by 10 <= 12: within
             r("p-s1", "p", 1, "b", 1, "llm-1", 0, 200, at=3, predicted=50),  # off by 50 > 20
             r("p-s1", "p", 1, "b", 2, "llm-1", 0, 10, at=4, predicted=None),  # no prediction: not counted
             r("p-s1", "p", 1, "c", 1, "llm-1", None, None, at=5, predicted=7, status=500, error="x")]  # failed
    second = [r("p-s2", "p", 2, "a", 1, "llm-0", 40, 60, at=0, predicted=0)]  # off by 40 > 10
    write_run(tmp_path, "p-s1", "p", 1, first)
    write_run(tmp_path, "p-s2", "p", 2, second)
    con = connect(tmp_path)
    runs = {run["run_id"]: run for run in per_run(con)}
    assert runs["p-s1"]["prediction_mae"] == pytest.approx(60 / 3)
    assert runs["p-s1"]["prediction_within_10"] == pytest.approx(2 / 3)
    pooled = summary(con)["p"]
    assert pooled["prediction_mae"]["value"] == pytest.approx(100 / 4)  # pooled over requests, not runs
    assert pooled["prediction_within_10"]["value"] == pytest.approx(2 / 4)
