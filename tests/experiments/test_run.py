import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.labs import DirectLab, free_port
from extproc.analysis.metrics import connect, per_run
from extproc.cli_input import UsageError
from extproc.experiments.lab import Lab
from extproc.experiments.run import run_experiment, run_order
from extproc.policy_spec import ExperimentError
from extproc.records import read_records, read_run_metadata
from extproc.traffic import generate_conversations, load_profile

TINY = replace(
    load_profile("quick"), name="tiny", concurrency=2, conversations=2, turns=(2, 2),
    doc_share=0.0, max_tokens=2, think_time_s=(0.0, 0.1), spawn_rate=10.0, max_duration_s=120,
)  # fmt: skip


def test_order_alternates_between_seeds():
    assert run_order(["a", "b"], [1, 2, 3]) == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]


def test_existing_out_dir_is_refused(tmp_path):
    with pytest.raises(UsageError, match="already exists"):
        run_experiment(DirectLab("127.0.0.1:1"), TINY, ["bounded"], [1], tmp_path)


def test_gateway_down_is_named(tmp_path):
    lab = DirectLab(f"127.0.0.1:{free_port()}")
    with pytest.raises(ExperimentError, match=r"gateway http://127.0.0.1:\d+ is not reachable"):
        run_experiment(lab, TINY, ["bounded"], [1], tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_cli_reports_bad_profile(tmp_path, capsys):
    from extproc.cli import main

    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"name": "p"}))
    assert main(["run", "--profile", str(bad), "--policies", "bounded", "--seeds", "1",
                 "--out-dir", str(tmp_path / "o"), "--gateway", "http://x", "--admin", "x:1"]) == 2  # fmt: skip
    assert "concurrency: missing" in capsys.readouterr().err


@pytest.mark.live
def test_experiment_records_every_request(replica, tmp_path):
    lab = DirectLab(replica)
    assert isinstance(lab, Lab)
    out = run_experiment(lab, TINY, ["bounded", "llm-aware"], [1, 2], tmp_path / "e", scale_at=1.0,
                         progress=lambda _: None)  # fmt: skip
    plan = json.loads((out / "experiment.json").read_text())["order"]
    assert plan == ["bounded-s1", "llm-aware-s1", "llm-aware-s2", "bounded-s2"]
    assert [c for c in lab.calls if c[0] == "set_policy"] == [
        ("set_policy", p) for p in ("bounded", "llm-aware", "llm-aware", "bounded")
    ]
    for run in per_run(connect(out)):
        expected = sum(len(c.turns) for c in generate_conversations(TINY, run["seed"]))
        assert run["requests"] == expected and run["errors"] == 0
        assert run["followups"] == 2 and run["hits"] == 2  # one replica: every follow-up hits
    rows = read_records(out / "bounded-s1" / "requests.parquet").to_pylist()
    assert all(r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["latency_s"] for r in rows)
    assert all(r["cache_n"] is not None and r["est_prompt_tokens"] > 0 for r in rows)
    meta = read_run_metadata(out / "bounded-s1")
    assert meta.status == "finished" and meta.scaled_to == 2 and meta.scale_ready_at is not None


@pytest.mark.live
def test_interrupted_run_keeps_its_rows(replica, tmp_path):
    slow = replace(TINY, conversations=4, turns=(4, 4), think_time_s=(0.5, 0.5))
    (tmp_path / "p.json").write_text(json.dumps({**slow.__dict__, "turns": [4, 4]}))
    script = (
        "import sys; sys.path.insert(0, sys.argv[3]); from experiments.labs import DirectLab; "
        "from extproc.experiments.run import run_experiment, ExperimentInterrupted; "
        "from extproc.traffic import load_profile\n"
        "try: run_experiment(DirectLab(sys.argv[1]), load_profile(sys.argv[2]), ['bounded'], [1], "
        "sys.argv[4])\nexcept ExperimentInterrupted as e: print(e); sys.exit(130)"
    )
    out = tmp_path / "e"
    process = subprocess.Popen(
        [sys.executable, "-c", script, replica, str(tmp_path / "p.json"), str(Path(__file__).parents[1]), str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    journal = out / "bounded-s1" / "requests.jsonl"
    deadline = time.monotonic() + 60
    while not (journal.exists() and journal.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 130 and "rows recorded so far" in stdout
    rows = read_records(out / "bounded-s1" / "requests.parquet").num_rows
    assert 2 <= rows < 16
    assert read_run_metadata(out / "bounded-s1").status == "interrupted"


def test_gateway_without_admin_is_refused(tmp_path, capsys):
    from extproc.cli import main

    assert main(["run", "--profile", "quick", "--policies", "bounded", "--seeds", "1",
                 "--out-dir", str(tmp_path / "o"), "--gateway", "http://127.0.0.1:1"]) == 2  # fmt: skip
    assert "--gateway needs --admin" in capsys.readouterr().err


def test_no_local_stack_is_named(tmp_path, capsys):
    from extproc.cli import main

    assert main(["run", "--profile", "quick", "--policies", "bounded", "--seeds", "1",
                 "--out-dir", str(tmp_path / "o"), "--run-dir", str(tmp_path / "none")]) == 2  # fmt: skip
    assert capsys.readouterr().err.startswith("llm-ring run: ")
    assert not (tmp_path / "o").exists()
