"""Calibration: a fit that recovers a known cost model, and one short live measurement."""

from __future__ import annotations

import argparse

import pytest

from extproc.sim.calibrate import configure, main
from extproc.sim.costmodel import load_cost_model
from extproc.sim.engine import Fleet
from extproc.sim.runs import SimConfig, Source, run_experiment
from extproc.sim.workload import profile_workload
from extproc.stack.models import smollm2_gguf
from extproc.traffic import load_profile
from tests.sim.helpers import simple_cost


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_fit_from_records_recovers_the_simulated_costs(tmp_path, monkeypatch):
    # One slot per replica: no CPU sharing, so every simulated timing follows the cost model exactly.
    truth = simple_cost()
    monkeypatch.setattr("extproc.sim.runs.load_cost_model", lambda _: truth)
    quick = load_profile("quick")
    source = Source("quick", lambda seed, _: profile_workload(quick, seed), False, quick)
    config = SimConfig(routing={"virtual_nodes": 100, "hash_seed": 0, "memory_capacity": 1000,
                                "speed_learning": True, "speed_ewma_weight": 0.05,
                                "prior_prefill_tokens_per_s": 167.0, "prior_decode_tokens_per_s": 55.0,
                                "prior_request_overhead_ms": 19.0,
                                "prior_model_load_ms": 1500.0, "prior_model_wake_ms": 1500.0,
                                "replicas": {"slots": 4, "cache_tokens": 100_000},
                                "bounded": {"epsilon": 0.25, "load_unit": "requests"}},
                       slots=1, cache_ram_mib=0, cost_model="simple", threads=1, host_cores=0, time_scale=1.0,
                       release_lag_ms=0.0, routers=1, router_state="separate",
                       store_lag_ms=0.0, store_handoff=False, store_outage=None, roll_restart_s=30.0,
                       migration_transfer_gb_per_s=1.0, migration_min_tokens=64, relieve_hot_spots=False)
    run_experiment(source, ["bounded"], [1, 2], config, Fleet(3, 1, 0), tmp_path / "exp")
    out = tmp_path / "fit.json"
    assert main(parse("--from-records", str(tmp_path / "exp"), "--name", "fit", "--kv-bytes-per-token", "1024",
                      "--out", str(out))) == 0
    fitted = load_cost_model(out)
    assert fitted.prefill_per_token_s == pytest.approx(truth.prefill_per_token_s, rel=1e-3)
    assert fitted.decode_per_token_s == pytest.approx(truth.decode_per_token_s, rel=1e-3)
    assert fitted.prefill_overhead_s == pytest.approx(0.0, abs=1e-3)


@pytest.mark.live
def test_live_calibration_of_a_real_replica(tmp_path):
    out = tmp_path / "smol.json"
    code = main(parse("--model", str(smollm2_gguf()), "--slots", "2", "--threads", "1", "--lengths", "16", "64",
                      "--repeats", "1", "--decode-tokens", "4", "--name", "smol", "--kv-bytes-per-token", "23040",
                      "--out", str(out)))
    assert code == 0
    model = load_cost_model(out)
    assert model.prefill_per_token_s > 0 and model.decode_per_token_s > 0
    assert len(model.prefill_slowdown) == len(model.decode_slowdown) == 2
    assert model.measured["points"]  # the raw measurements are kept in the file
