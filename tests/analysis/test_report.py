import json

import pytest

from analysis.fixtures import known_run, make_experiment, write_run
from extproc.cli import main


def test_table_is_printed_and_summary_md_written_when_asked(tmp_path, capsys):
    make_experiment(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header, rule, first = out.splitlines()[:3]
    assert header.split() == ["metric", "(mean", "±", "95%", "CI", "over", "seeds)", "bounded", "llm-aware"]
    assert first.startswith("Cache hit rate (follow-up turns)") and "%" in first
    assert not (tmp_path / "summary.md").exists()  # reading a folder leaves it as it is
    assert main(["report", str(tmp_path), "--write"]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "| metric (mean ± 95% CI over seeds) | bounded | llm-aware |" in md
    assert "## Runs" in md and "llm-aware-s3" in md


def test_markdown_format(tmp_path, capsys):
    write_run(tmp_path, "bounded-s1", "bounded", 1, known_run())
    assert main(["report", str(tmp_path), "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "| Cache hit rate (follow-up turns) | 50.0% |" in out
    assert "| Avoidable misses (history cached elsewhere) per run | 1 |" in out
    # no scale-up in this run: its rows are left out rather than shown empty
    assert "scale-up" not in out


def test_json_format_is_one_object(tmp_path, capsys):
    write_run(tmp_path, "bounded-s1", "bounded", 1, known_run())
    assert main(["report", str(tmp_path), "--format", "json", "--hit-share", "1.0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hit_share"] == 1.0
    assert report["summary"]["bounded"]["hit_rate"]["value"] == 0.25
    assert [run["run_id"] for run in report["runs"]] == ["bounded-s1"]


def test_not_an_experiment_folder(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no */requests.parquet" in capsys.readouterr().err


def test_several_folders_side_by_side_with_decision_agreement(tmp_path, capsys):
    live, sim = tmp_path / "live", tmp_path / "sim"
    write_run(live, "bounded-s1", "bounded", 1, known_run())
    write_run(live, "llm-aware-s1", "llm-aware", 1, known_run("llm-aware-s1", "llm-aware"))
    differing = known_run()
    differing[2] = {**differing[2], "replica": "llm-0"}  # one of 8 decisions differs (c1, turn 3)
    differing[1] = {**differing[1], "cache_n": 50, "prompt_n": 80}  # c1, turn 2: still a hit, 50 tokens fewer cached
    write_run(sim, "bounded-s1", "bounded", 1, differing)
    assert main(["report", str(live), str(sim), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # grouped by policy; a policy missing from one folder has no column there
    assert list(report["summary"]) == ["live: bounded", "sim: bounded", "live: llm-aware"]
    assert report["summary"]["live: bounded"]["avoidable_misses"]["value"] == 1
    assert report["summary"]["sim: bounded"]["avoidable_misses"]["value"] == 0
    assert report["agreement"]["with"] == "live"
    assert report["agreement"]["by_label"]["sim"] == {
        "bounded": {"matched": 8, "same_replica": 7 / 8, "same_replica_first_turn": 1.0},
    }
    assert {run["experiment"] for run in report["runs"]} == {"live", "sim"}
    assert not (live / "summary.md").exists() and not (sim / "summary.md").exists()
    # the cache_n of the 7 answered requests over their cache_n + prompt_n
    assert report["summary"]["live: bounded"]["cached_share"]["value"] == 375 / 815
    # paired by seed, for the policies both hold: 50 of the 815 prompt tokens fewer cached, as many hits
    assert list(report["paired"]) == ["sim: bounded - live: bounded"]
    paired = report["paired"]["sim: bounded - live: bounded"]
    assert paired["cached_share"]["mean"] == pytest.approx(-50 / 815) and paired["hit_rate"]["mean"] == 0

    assert main(["report", str(live), str(sim)]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.startswith("metric ") and "sim: bounded" in header
    assert "- sim: bounded 87.5% of 8 (first turns 100.0%)" in out
    assert "paired by seed, difference to live:" in out and "sim: bounded - live: bounded" in out


def test_folders_with_the_same_name_are_labelled_by_path(tmp_path, capsys):
    first, second = tmp_path / "a" / "run", tmp_path / "b" / "run"
    for folder in (first, second):
        write_run(folder, "bounded-s1", "bounded", 1, known_run())
    assert main(["report", str(first), str(second), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["summary"]) == [f"{first}: bounded", f"{second}: bounded"]
    assert report["agreement"]["by_label"][str(second)]["bounded"]["same_replica"] == 1.0


def test_sim_and_report_print_the_same_statistic_for_a_folder(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["sim", "--profile", "quick", "--policies", "bounded", "llm-aware", "--seeds", "1-3",
                 "--out-dir", str(out)]) == 0
    simulated = capsys.readouterr().out.splitlines()
    assert main(["report", str(out)]) == 0
    reported = capsys.readouterr().out.splitlines()
    table = reported[: reported.index(next(line for line in reported if line.startswith("Runs (seeds)"))) + 1]
    assert table[0].startswith("metric (mean ± 95% CI over seeds)") and "±" in table[2]
    start = simulated.index(table[0])
    assert simulated[start : start + len(table)] == table
