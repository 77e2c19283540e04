"""`llm-ring bench gateway` end to end, tiny: every mode measured, medians over rounds, the table."""

from __future__ import annotations

import argparse

import pytest

from extproc.bench.gateway import (
    FLOW_MODE,
    MODES,
    POOL_MODES,
    STORE_MODE,
    configure,
    main,
    median_cell,
    render_table,
    run,
)
from extproc.bench.side_by_side import WINDOWS, render_side_by_side, run_side_by_side
from extproc.stack.redis_server import redis_server_binary

pytestmark = pytest.mark.live


def test_every_mode_is_measured_and_ext_proc_really_is_in_the_path() -> None:
    args = argparse.Namespace(concurrency=[2], seconds=0.3, rounds=2, conversations=20, envoy_concurrency=1, keep=False)
    result = run(args)
    cells = {cell["mode"]: cell for cell in result["cells"]}
    assert set(cells) == set(MODES) and result["rounds"] == 2
    assert all(cell["requests"] > 0 and cell["errors"] == 0 for cell in cells.values())
    # a routed request costs the service CPU
    assert cells["envoy+ext_proc"]["ext_proc_cpu_us_per_request"] > 0
    table = render_table(result)
    assert "targets:" in table and "median of 2 rounds" in table
    assert f"load average {result['load_average_1m_at_start']} at the start" in table
    quiet, busy = dict(result, load_average_1m_at_start=0.0), dict(result, load_average_1m_at_start=99.0)
    assert "was busy" not in render_table(quiet) and "was busy before the benchmark started" in render_table(busy)


def test_a_cell_is_the_median_of_its_rounds() -> None:
    runs = [
        {"requests": 10, "errors": 0, "rps": 100.0, "p50_ms": 1.0, "p99_ms": 9.0},
        {"requests": 30, "errors": 1, "first_error": "HTTP/1.1 503", "rps": 300.0, "p50_ms": 3.0, "p99_ms": 2.0},
        {"requests": 20, "errors": 0, "rps": 200.0, "p50_ms": 2.0, "p99_ms": 4.0},
    ]
    expected = {"requests": 60, "errors": 1, "first_error": "HTTP/1.1 503", "rps": 200.0, "p50_ms": 2.0, "p99_ms": 4.0}
    assert median_cell(runs) == expected


@pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server: `make setup` installs it")
def test_with_store_on_a_service_sharing_state_through_redis_is_measured_too() -> None:
    args = argparse.Namespace(concurrency=[2], seconds=0.3, rounds=1, conversations=20, envoy_concurrency=1,
                              keep=False, store=["on", "off"])
    result = run(args)
    cells = {cell["mode"]: cell for cell in result["cells"]}
    assert set(cells) == {*MODES, STORE_MODE} and cells[STORE_MODE]["errors"] == 0
    assert cells[STORE_MODE]["ext_proc_cpu_us_per_request"] > 0
    assert result["store"]["in_use_at_end"] and {"store_rps", "store_over_ext_proc_p50_ms"} <= set(result["added"][0])
    table = render_table(result)
    assert "the shared store" in table
    row = result["added"][0]
    assert f"{row['store_rps']:.0f} req/s = {row['store_rps_over_floor']:.2f} x the floor (without the store" in table


def test_with_mode_pool_the_inference_pool_data_plane_is_measured_against_its_own_floor() -> None:
    args = argparse.Namespace(concurrency=[2], seconds=0.3, rounds=1, conversations=20, envoy_concurrency=1,
                              keep=False, mode=["own", "pool"])
    result = run(args)
    cells = {cell["mode"]: cell for cell in result["cells"]}
    assert set(cells) == {*MODES, *POOL_MODES}
    assert all(cells[mode]["requests"] > 0 and cells[mode]["errors"] == 0 for mode in POOL_MODES)
    assert cells["pool+ext_proc"]["ext_proc_cpu_us_per_request"] > 0
    row = result["added"][0]
    assert row["pool_rps_over_floor"] and row["own_rps_over_floor"]
    assert "ratios to the floor of the same data plane and run" in render_table(result)


def test_with_flow_on_the_service_with_flow_control_routes_every_request_at_once() -> None:
    args = argparse.Namespace(concurrency=[2], seconds=0.3, rounds=1, conversations=20, envoy_concurrency=1,
                              keep=False, flow=["off", "on"])
    result = run(args)
    cells = {cell["mode"]: cell for cell in result["cells"]}
    assert set(cells) == {*MODES, FLOW_MODE}
    assert cells[FLOW_MODE]["requests"] > 0 and cells[FLOW_MODE]["errors"] == 0
    assert cells[FLOW_MODE]["ext_proc_cpu_us_per_request"] > 0
    assert result["flow"]["at_once"] >= cells[FLOW_MODE]["requests"] and result["flow"]["other"] == 0
    assert len(cells[FLOW_MODE]["cpu_ratios"]) == 1 and cells[FLOW_MODE]["rps_ratio"] > 0
    assert "flow control on (envoy+ext_proc+flow: nothing waits" in render_table(result)
    assert "round by round, over ext_proc without it: req/s" in render_table(result)


def test_with_paced_flow_control_is_measured_side_by_side_against_an_identical_service() -> None:
    args = argparse.Namespace(flow=["off", "on"], paced=60.0, rounds=1, seconds=0.5)
    result = run_side_by_side(args)
    (one_set,) = result["sets"]
    assert sorted(one_set["started"]) == ["off", "on", "same"]
    # every window's requests went through flow control at once (its warm-up's too)
    assert one_set["flow"]["other"] == 0 and one_set["flow"]["at_once"] >= WINDOWS * 60 * 0.5 * 0.9
    for median, low, high in result["ratios"].values():
        assert 0 < low <= median <= high
    text = render_side_by_side(result)
    assert "ext_proc CPU per request, on / off" in text and "ext_proc CPU per request, same / off" in text


@pytest.mark.parametrize("flags", [["--paced", "50"], ["--flow", "off", "on", "--paced", "-1"]])
def test_paced_without_both_flow_modes_or_with_no_rate_is_refused(flags: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    assert main(parser.parse_args(flags)) == 2
    assert capsys.readouterr().err.count("\n") == 1
