"""`llm-ring sim` end to end: experiment folders the shared analysis reads, and clear errors."""

from __future__ import annotations

import json

import pytest

from extproc.cli import main
from extproc.records import read_records
from tests.sim.test_mooncake import write


def test_profile_runs_land_in_experiment_folders(tmp_path, capsys):
    code = main(["sim", "--profile", "quick", "--policies", "bounded", "llm-aware:epsilon=0.5", "--seeds", "1-2",
                 "--replicas", "2", "3", "--scale-at", "5", "--host-cores", "2", "--out-dir", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "quick: 2 replicas, 2 seeds" in out and "Cache hit rate (follow-up turns)" in out
    tmp_path = tmp_path / "out"
    runs = sorted(p.name for p in (tmp_path / "replicas-3").iterdir() if p.is_dir())
    assert runs == ["sim-quick-r3-bounded-s1", "sim-quick-r3-bounded-s2",
                    "sim-quick-r3-llm-aware_epsilon=0.5-s1", "sim-quick-r3-llm-aware_epsilon=0.5-s2"]
    table = read_records(tmp_path / "replicas-3" / runs[0] / "requests.parquet")
    assert set(table.column("simulated").to_pylist()) == {True}
    assert "llm-3" in set(table.column("replica").to_pylist())  # the scale-up replica served
    meta = json.loads((tmp_path / "replicas-3" / runs[0] / "run.json").read_text())
    assert (meta["simulated"], meta["scale_at_s"], meta["scaled_to"]) == (True, 5.0, 4)
    assert meta["extra"]["host_cores"] == 2.0
    assert (tmp_path / "replicas-2" / "summary.md").exists()


def test_trace_json_output(tmp_path, capsys):
    trace = write(tmp_path, [{"timestamp": 100 * i, "input_length": 700, "output_length": 4,
                              "hash_ids": [i % 3, 10 + i]} for i in range(12)])
    code = main(["sim", "--trace", str(trace), "--policies", "consistent", "--seeds", "1", "2",
                 "--out-dir", str(tmp_path / "out"), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seeds"] == [1, 2]
    assert result["replicas"]["3"]["consistent"]["requests"]["value"] == 12
    assert result["paired"] == {"against": "consistent", "replicas": {"3": {}}}  # one policy: nothing to pair


@pytest.mark.parametrize(("options", "message"), [
    (["--policies", "bounded:epsilon=oops", "--seeds", "1"], "epsilon"),
    (["--policies", "bounded", "--seeds", "x"], "--seeds: 'x'"),
    (["--policies", "bounded", "--seeds", "1", "--cost-model", "nope"], "cost model not found: nope"),
    (["--policies", "nope", "--seeds", "1"], "unknown policy 'nope'"),
    (["--policies", "bounded", "--seeds", "1", "--scale-at", "0"], "--scale-at must be > 0"),
    (["--policies", "bounded", "--seeds", "1", "--model", "smollm2", "--models", "smollm2:1"],
     "--model: router mode names each conversation's model"),
])
def test_bad_inputs_are_named(tmp_path, capsys, options, message):
    assert main(["sim", "--profile", "quick", *options, "--out-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
