"""Mixed fleets and slowdowns in the simulator; the router learns only from the simulated timings."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from extproc.cli import main
from extproc.sim.costmodel import load_cost_model


def test_a_mixed_fleet_with_a_slowdown_records_learnt_and_true_speeds(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["sim", "--profile", "quick", "--policies", "llm-aware", "--seeds", "1",
                 "--cost-model", "smollm2-135m:1", "qwen05b-shape:2", "--slow", "llm-2:4:3", "--out-dir", str(out)])
    assert code == 0
    assert "quick: 3 replicas" in capsys.readouterr().out
    run = out / "sim-quick-r3-llm-aware-s1"
    meta = json.loads((run / "run.json").read_text())
    assert meta["extra"]["models"] == ["smollm2-135m", "qwen05b-shape", "qwen05b-shape"]
    assert meta["extra"]["slow"] == [["llm-2", 4.0, 3.0]]
    rows = pq.read_table(run / "speeds.parquet").to_pylist()
    served = {(row["replica"], row["cost_model"]) for row in rows}
    assert served <= {("llm-0", "smollm2-135m"), ("llm-1", "qwen05b-shape"), ("llm-2", "qwen05b-shape")}
    qwen = load_cost_model("qwen05b-shape")
    solo = 1 / qwen.prefill_per_token_s
    slowed = [row for row in rows if row["replica"] == "llm-2"]
    assert slowed and all(abs(row["true_prefill_tokens_per_s"] - (solo / 3 if row["at_s"] > 4 else solo)) < 1e-6
                          for row in slowed)
    # learnt from the timings alone: it moves off the prior (167 tokens/s) after the first answers
    assert any(abs(row["learnt_prefill_tokens_per_s"] - 167.0) > 1 for row in rows)


def test_mixed_fleet_inputs_are_checked(tmp_path, capsys):
    base = ["sim", "--profile", "quick", "--policies", "llm-aware", "--seeds", "1", "--out-dir", str(tmp_path / "o")]
    assert main([*base, "--cost-model", "smollm2-135m:0", "qwen05b-shape:1"]) == 2
    assert "--cost-model: 'smollm2-135m:0' is not NAME:COUNT" in capsys.readouterr().err
    assert main([*base, "--cost-model", "smollm2-135m:1", "qwen05b-shape"]) == 2
    assert "'qwen05b-shape' is not NAME:COUNT" in capsys.readouterr().err
    assert main([*base, "--cost-model", "smollm2-135m:1", "qwen05b-shape:1", "--replicas", "3"]) == 2
    assert "a mixed --cost-model has 2 replicas" in capsys.readouterr().err
    assert main([*base, "--slow", "llm-7:1:2"]) == 2
    assert "--slow: 'llm-7:1:2': REPLICA one of llm-0..llm-2" in capsys.readouterr().err
    assert main([*base, "--slow", "llm-1:x:2"]) == 2
    assert "is not REPLICA:AT:FACTOR" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
