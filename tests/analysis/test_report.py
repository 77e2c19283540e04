import json

from analysis.fixtures import known_run, make_experiment, write_run
from extproc.cli import main


def test_table_is_printed_and_summary_md_written(tmp_path, capsys):
    make_experiment(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header, rule, first = out.splitlines()[:3]
    assert header.split() == ["metric", "bounded", "llm-aware"]
    assert first.startswith("Cache hit rate (follow-up turns)") and "%" in first
    md = (tmp_path / "summary.md").read_text()
    assert "| metric | bounded | llm-aware |" in md and "## Runs" in md and "llm-aware-s3" in md


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
