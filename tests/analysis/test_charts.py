"""`llm-ring report --charts OUTDIR --html FILE`: the charts as PNG and SVG, drawn from the same
queries as the tables; one self-contained HTML page; bad input refused with nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from analysis.fixtures import make_experiment
from extproc.analysis import pictures
from extproc.analysis.charts import figures, open_sources, time_bin
from extproc.analysis.metrics import format_cell
from extproc.analysis.report import build_report, combine
from extproc.cli import main


def datasets(chart) -> list[list[dict]]:
    """The rows a chart carries inline, one list per data source, in the spec's order."""
    found: list[list[dict]] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("data"), dict) and "values" in node["data"]:
                found.append(node["data"]["values"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(chart.to_dict())
    return found


ALL_CHARTS = {"summary", "hit_rate_over_time", "latency_ttft", "route_reasons", "learnt_speeds"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real simulation of a mixed fleet with a slowdown: its llm-aware runs write speeds.parquet."""
    out = tmp_path_factory.mktemp("sim") / "sim"
    assert main(["sim", "--profile", "quick", "--policies", "bounded", "llm-aware", "--seeds", "1-3",
                 "--cost-model", "smollm2-135m:1", "qwen05b-shape:1", "--slow", "llm-1:4:3",
                 "--out-dir", str(out)]) == 0  # fmt: skip
    return out


def test_every_chart_is_written_as_png_and_svg(sim: Path, tmp_path: Path, capsys) -> None:
    charts = tmp_path / "charts"
    assert main(["report", str(sim), "--charts", str(charts)]) == 0
    assert "Cache hit rate" in capsys.readouterr().out  # the table is printed as before
    assert {path.name for path in charts.iterdir()} == {f"{n}.{s}" for n in ALL_CHARTS for s in ("png", "svg")}
    for name in ALL_CHARTS:
        assert (charts / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        svg = (charts / f"{name}.svg").read_text()
        assert svg.startswith("<svg") and re.search(r'class="mark-\w+ role-mark', svg), name


def test_the_summary_chart_shows_the_tables_numbers(sim: Path, tmp_path: Path) -> None:
    """Its bars are the table's means, its labels the table's cells: one query, not two."""
    report = build_report(sim)
    assert main(["report", str(sim), "--charts", str(tmp_path / "charts")]) == 0
    svg = (tmp_path / "charts" / "summary.svg").read_text()
    from extproc.analysis.metrics import METRICS

    hit_rate = next(metric for metric in METRICS if metric.name == "hit_rate")
    for policy, stats in report["summary"].items():
        assert format_cell(hit_rate, stats["hit_rate"]).replace("±", "&#177;") in svg.replace("±", "&#177;"), policy
    chart = figures(open_sources([sim]), report["summary"])["summary"].chart
    means = {policy: stats["hit_rate"]["mean"] for policy, stats in report["summary"].items()}
    assert means in [{row["series"]: row["mean"] for row in rows} for rows in datasets(chart)]


def test_folders_side_by_side_are_series_of_their_own(sim: Path, tmp_path: Path) -> None:
    live = make_experiment(tmp_path / "live")
    report = combine([live, sim], [build_report(live), build_report(sim)])
    drawn = figures(open_sources([live, sim]), report["summary"])
    lines, marks = datasets(drawn["hit_rate_over_time"].chart)
    assert {row["series"] for row in lines} == set(report["summary"])  # "live: bounded", "sim: llm-aware", ...
    assert {row["series"] for row in marks} == {"live: bounded", "live: llm-aware"}  # the fixture's scale-up
    (speeds,) = datasets(drawn["learnt_speeds"].chart)
    assert {row["series"] for row in speeds} == {"sim: sim-quick-r2-llm-aware-s1"}


def test_a_folder_without_speeds_or_ttft_draws_what_it_has(tmp_path: Path) -> None:
    folder = make_experiment(tmp_path / "live")
    drawn = figures(open_sources([folder]), build_report(folder)["summary"])
    assert set(drawn) == ALL_CHARTS - {"learnt_speeds"}


@pytest.mark.parametrize("longest, width", [(0, 1), (15, 1), (24, 1), (25, 2), (600, 30), (3000, 300)])
def test_time_bins_are_round_and_at_most_24(longest: float, width: float) -> None:
    assert time_bin(longest) == width


def test_the_html_report_is_one_page_with_tables_charts_command_and_machine(sim: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    assert main(["report", str(sim), "--html", str(page)]) == 0
    text = page.read_text()
    markup = re.sub(r"(<script[^>]*>).*?</script>", r"\1</script>", text, flags=re.S)  # the scripts' text aside
    assert markup.count("<script") == 2 and not re.search(r"\ssrc=|<link\b", markup), "loads nothing from elsewhere"
    specs = json.loads(re.search(r'<script type="application/json" id="specs">(.*?)</script>', text, re.S)[1])
    assert set(specs) == ALL_CHARTS
    assert all(f'id="chart-{name}"' in text for name in ALL_CHARTS)
    assert f"llm-ring report {sim} --html {page}" in text
    assert pictures.machine().split(":")[0] in text and "Cache hit rate (follow-up turns)" in text
    assert "sim-quick-r2-llm-aware-s3" in text  # the runs table


def test_charts_replace_their_old_files_and_leave_the_folders_other_files(sim: Path, tmp_path: Path) -> None:
    charts = tmp_path / "charts"
    charts.mkdir()
    (charts / "notes.txt").write_text("mine")
    (charts / "summary.png").write_bytes(b"old")
    assert main(["report", str(sim), "--charts", str(charts)]) == 0
    assert (charts / "notes.txt").read_text() == "mine"
    assert (charts / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".partial")]


@pytest.mark.parametrize("problem", ["empty folder", "no records", "charts under a file", "html is a folder",
                                     "charts is a file"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(problem: str, sim: Path, tmp_path: Path, capsys) -> None:
    folder, charts, page = sim, tmp_path / "charts", tmp_path / "report.html"
    if problem == "empty folder":
        folder = tmp_path / "empty"
        folder.mkdir()
    elif problem == "no records":
        folder = tmp_path / "none"
        from extproc.records import write_records

        write_records([], folder / "run" / "requests.parquet")
    elif problem == "charts under a file":
        (tmp_path / "file").write_text("")
        charts = tmp_path / "file" / "charts"
    elif problem == "html is a folder":
        page.mkdir()
    else:
        charts.write_text("")
    before = sorted(path.name for path in tmp_path.iterdir())
    assert main(["report", str(folder), "--charts", str(charts), "--html", str(page)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("llm-ring report: "), err
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_a_failure_while_drawing_writes_nothing(sim: Path, tmp_path: Path, monkeypatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(pictures.vl_convert, "vegalite_to_svg", broken)
    with pytest.raises(RuntimeError, match="drawing failed"):
        main(["report", str(sim), "--charts", str(tmp_path / "charts"), "--html", str(tmp_path / "report.html")])
    assert list(tmp_path.iterdir()) == []


def test_sim_says_how_to_draw_its_pictures(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["sim", "--profile", "quick", "--policies", "bounded", "--seeds", "1", "--out-dir", str(out)]) == 0
    hint = f"llm-ring report {out} --charts {out / 'charts'} --html {out / 'report.html'}"
    assert hint in capsys.readouterr().err
