"""`llm-ring report DIR [DIR ...]`: the summary table of one or more experiment folders.

Prints the per-policy summary (table, markdown or JSON); with ``--write`` it also
(re)writes each ``DIR/summary.md`` (summary + per-run table + the definitions used),
which `llm-ring run` and `sim` write once when they finish; ``--charts OUTDIR`` writes
every chart as PNG and SVG (extproc/analysis/charts.py) and ``--html FILE`` one
self-contained HTML report (extproc/analysis/pictures.py). Given several folders (a
live run and its simulation, say), the columns sit side by side, grouped by policy:
``live: bounded``, ``sim: bounded``, ``live: llm-aware``, ..., followed by each later folder's
differences to the first, paired by seed, for every policy both hold (three routers against
one, say: the same seeds are the same conversations).

Every table shows one statistic, the same as `llm-ring sim` prints: the mean over runs
(one run per seed) with a 95 % t-interval of the per-run values. The JSON also holds
the pooled value (``value``: pooled counts and quantiles over all requests), min and max.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from extproc.analysis.metrics import (
    DEFAULT_HIT_SHARE,
    METRICS,
    Metric,
    connect,
    decision_agreement,
    folder_labels,
    format_cell,
    paired_differences,
    per_run,
    summary,
)
from extproc.cli_input import UsageError

SUMMARY_FILE = "summary.md"
REPO_ROOT = Path(__file__).resolve().parents[2]
STATISTIC = "mean ± 95% CI over seeds"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                        help="experiment folder (written by `llm-ring run` or `sim`); several: side by side")
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    parser.add_argument(
        "--hit-share",
        type=float,
        default=DEFAULT_HIT_SHARE,
        help="a follow-up is a hit when cache_n >= this share of the previous prompt (default 0.5)",
    )
    parser.add_argument("--write", action="store_true", help=f"also rewrite each DIR/{SUMMARY_FILE}")
    parser.add_argument("--charts", type=Path, metavar="OUTDIR",
                        help="also write every chart as OUTDIR/NAME.png and OUTDIR/NAME.svg")
    parser.add_argument("--html", type=Path, metavar="FILE",
                        help="also write one self-contained HTML report: the tables, the charts, the command, "
                             "the machine")


def main(args: argparse.Namespace) -> int:
    from extproc.analysis.pictures import check_target

    for target, flag, folder in ((args.charts, "--charts", True), (args.html, "--html", False)):
        if target is not None:
            check_target(target, flag, folder)
    try:
        reports = [build_report(folder, args.hit_share) for folder in args.dirs]
    except (FileNotFoundError, ValueError) as exc:  # bad input: one line, exit 2
        raise UsageError(str(exc)) from None
    for folder, one in zip(args.dirs, reports, strict=True) if args.write else ():
        (folder / SUMMARY_FILE).write_text(render_markdown(one, with_runs=True))
    report = combine(args.dirs, reports)
    if args.charts or args.html:
        write_pictures(args.dirs, report, args.charts, args.html,
                       report_command(args.dirs, args.charts, args.html, args.hit_share))
    if args.format == "json":
        print(json.dumps(report, default=str))
    elif args.format == "markdown":
        print(render_markdown(report, with_runs=False), end="")
    else:
        print(render_table(report), end="")
    return 0


def build_report(experiment_dir: str | Path, hit_share: float = DEFAULT_HIT_SHARE) -> dict[str, Any]:
    try:
        con = connect(experiment_dir, hit_share)
        return {
            "experiment": str(experiment_dir),
            "hit_share": hit_share,
            "summary": summary(con),
            "runs": per_run(con),
        }
    except duckdb.Error as exc:  # a corrupt or foreign file in the folder
        raise UsageError(f"{experiment_dir}: cannot read the records: {str(exc).splitlines()[0]}") from None


def combine(folders: list[Path], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One folder's report as it is; several side by side, with decision agreement to the first."""
    if len(reports) == 1:
        return reports[0]
    labels = folder_labels(folders)
    agreement = {
        label: decision_agreement(folders[0], folder) for label, folder in zip(labels[1:], folders[1:], strict=True)
    }
    return side_by_side(reports, labels, agreement)


def side_by_side(reports: list[dict[str, Any]], labels: list[str],
                 agreement: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report whose columns are ``label: policy``, grouped by policy (first seen first).

    ``agreement``: per later label, ``decision_agreement`` with the first folder.
    """
    policies = list(dict.fromkeys(policy for report in reports for policy in report["summary"]))
    labelled = list(zip(labels, reports, strict=True))
    return {
        "experiment": ", ".join(f"{label} = {report['experiment']}" for label, report in labelled),
        "hit_share": reports[0]["hit_share"],
        "summary": {
            f"{label}: {policy}": report["summary"][policy]
            for policy in policies
            for label, report in labelled
            if policy in report["summary"]
        },
        "runs": [{**run, "experiment": label} for label, report in labelled for run in report["runs"]],
        "agreement": {"with": labels[0], "by_label": agreement},
        "paired": paired_to_first(labelled),
    }


def paired_to_first(labelled: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each later folder's differences to the first, paired by seed, per policy both hold:
    ``"later: policy - first: policy"``."""
    first, base = labelled[0]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    runs = [{**run, "column": f"{label}: {run['policy']}"} for label, report in labelled for run in report["runs"]]
    for label, report in labelled[1:]:
        for policy in (policy for policy in report["summary"] if policy in base["summary"]):
            out |= paired_differences(runs, [f"{first}: {policy}", f"{label}: {policy}"],
                                      lambda run: str(run["column"]))
    return out


def write_pictures(folders: list[Path], report: dict[str, Any], charts_dir: Path | None, html_file: Path | None,
                   command: str) -> None:
    """The charts of ``report`` (``combine(folders, ...)``) as PNG and SVG into ``charts_dir``, and
    the HTML report into ``html_file``; both rendered before either is written."""
    from extproc.analysis import pictures
    from extproc.analysis.charts import figures, open_sources
    from extproc.files import write_atomically

    if not report["summary"]:
        raise UsageError(f"{', '.join(map(str, folders))}: the records hold no request")
    drawn = figures(open_sources(folders, report["hit_share"]), report["summary"])
    files = pictures.chart_files(drawn) if charts_dir else {}
    page = html_file and pictures.page(
        f"llm-ring report: {report['experiment']}", command, pictures.machine(), pictures.now(),
        pictures.Table(f"Summary per policy ({STATISTIC})", *summary_rows(report["summary"]),
                       notes=tuple(_footnote(report).splitlines())),
        drawn, [pictures.Table("Runs", *runs_rows(report))], pictures.vega_bundle(),
    )
    if charts_dir:
        pictures.write_folder(charts_dir, files)
    if html_file and page:
        write_atomically(html_file, page)


def pictures_hint(folder: Path) -> str:
    """How to draw a folder's charts and HTML report (printed by `llm-ring run` and `sim`)."""
    return "charts (PNG, SVG) and an HTML report: " + report_command([folder], folder / "charts",
                                                                     folder / "report.html")


def report_command(folders: Sequence[Path], charts: Path | None, html: Path | None,
                   hit_share: float = DEFAULT_HIT_SHARE) -> str:
    """The `llm-ring report` command line that draws these pictures."""
    words = ["llm-ring", "report", *map(str, folders)]
    if hit_share != DEFAULT_HIT_SHARE:
        words += ["--hit-share", f"{hit_share:g}"]
    words += [word for flag, value in (("--charts", charts), ("--html", html)) if value
              for word in (flag, str(value))]
    return " ".join(map(shlex.quote, words))


def resolve_folders(folders: list[str | Path], root: Path = REPO_ROOT) -> list[Path]:
    """Experiment folders as the notebooks take them: a relative path is relative to the checkout."""
    return [Path(folder) if Path(folder).is_absolute() else root / folder for folder in folders]


def summary_rows(
    stats: dict[str, dict[str, dict[str, Any]]], metrics: Sequence[Metric] = METRICS
) -> tuple[list[str], list[list[str]]]:
    """Metric rows, one column per policy (metrics no column has are left out)."""
    columns = list(stats)
    header = [f"metric ({STATISTIC})", *columns]
    body = [
        [metric.label, *(format_cell(metric, stats[c][metric.name]) for c in columns)]
        for metric in metrics
        if any(stats[c][metric.name]["mean"] is not None for c in columns)
    ]
    body.append(["Runs (seeds)", *(str(stats[c]["requests"]["n_runs"]) for c in columns)])
    return header, body


def render_stats(stats: dict[str, dict[str, dict[str, Any]]], metrics: Sequence[Metric] = METRICS) -> str:
    """``summary_rows`` as aligned text."""
    header, body = summary_rows(stats, metrics)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def render_table(report: dict[str, Any]) -> str:
    paired = report.get("paired")
    differences = f"\npaired by seed, difference to {report['agreement']['with']}:\n{render_stats(paired)}\n" \
        if paired else ""
    return render_stats(report["summary"]) + "\n" + _footnote(report) + "\n" + differences


def render_markdown(report: dict[str, Any], with_runs: bool) -> str:
    header, body = summary_rows(report["summary"])
    out = [f"# Summary: {report['experiment']}", "", *_md_table(header, body), "", _footnote(report)]
    if with_runs:
        out += ["", "## Runs", "", *_md_table(*runs_rows(report))]
    return "\n".join(out) + "\n"


def runs_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per run (and its folder, side by side)."""
    columns = ["run_id", "policy", "seed", "requests", "errors", "followups", "hit_rate",
               "avoidable_misses", "redirects", "latency_p50", "latency_p95", "imbalance",
               "moved_share"]  # fmt: skip
    if any("experiment" in run for run in report["runs"]):
        columns.insert(0, "experiment")
    return columns, [[_plain(run[c]) for c in columns] for run in report["runs"]]


def _footnote(report: dict[str, Any]) -> str:
    return (
        f"Mean over runs (one per seed) ± 95% t-interval; one run: its value. Hit = follow-up turn with cache_n >= "
        f"{report['hit_share']:g} x the previous turn's prompt tokens. Definitions: "
        f"extproc/analysis/metrics.py."
    ) + "".join(f"\n{line}" for line in _agreement_lines(report))


def _agreement_lines(report: dict[str, Any]) -> list[str]:
    agreement = report.get("agreement")
    if not agreement:
        return []
    lines = [f"Same replica as {agreement['with']}, request by request (same policy, seed, conversation, turn):"]
    for label, policies in agreement["by_label"].items():
        cells = [f"{policy} {100 * row['same_replica']:.1f}% of {row['matched']} "
                 f"(first turns {_percent(row['same_replica_first_turn'])})" for policy, row in policies.items()]
        lines.append(f"- {label}: " + ("; ".join(cells) if cells else "no request in common"))
    return lines


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in body),
    ]


def _plain(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
