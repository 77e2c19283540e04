"""`llm-ring report DIR`: the summary table of an experiment folder.

Prints the per-policy summary (table, markdown or JSON) and always writes
``DIR/summary.md`` (summary + per-run table + the definitions used).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from extproc.analysis.metrics import DEFAULT_HIT_SHARE, METRICS, Metric, connect, per_run, summary

SUMMARY_FILE = "summary.md"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="experiment folder (written by `llm-ring run` or `sim`)")
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    parser.add_argument(
        "--hit-share",
        type=float,
        default=DEFAULT_HIT_SHARE,
        help="a follow-up is a hit when cache_n >= this share of the previous prompt (default 0.5)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        report = build_report(args.dir, args.hit_share)
    except (FileNotFoundError, ValueError) as exc:
        print(f"llm-ring report: {exc}", file=sys.stderr)
        return 2
    (args.dir / SUMMARY_FILE).write_text(render_markdown(report, with_runs=True))
    if args.format == "json":
        print(json.dumps(report, default=str))
    elif args.format == "markdown":
        print(render_markdown(report, with_runs=False), end="")
    else:
        print(render_table(report), end="")
    return 0


def build_report(experiment_dir: str | Path, hit_share: float = DEFAULT_HIT_SHARE) -> dict[str, Any]:
    con = connect(experiment_dir, hit_share)
    return {
        "experiment": str(experiment_dir),
        "hit_share": hit_share,
        "summary": summary(con),
        "runs": per_run(con),
    }


def format_value(metric: Metric, value: float | None) -> str:
    if value is None:
        return "-"
    if metric.kind == "pct":
        return f"{100 * value:.1f}%"
    if metric.kind == "seconds":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if metric.kind == "ratio":
        return f"{value:.3f}"
    return f"{value:.1f}" if value != int(value) else f"{int(value)}"


def format_cell(metric: Metric, stats: dict[str, Any]) -> str:
    """The pooled value, then the range across runs when there are several."""
    cell = format_value(metric, stats["value"])
    if stats["n_runs"] >= 2 and stats["min"] is not None and stats["min"] != stats["max"]:
        cell += f" [{format_value(metric, stats['min'])}–{format_value(metric, stats['max'])}]"
    return cell


def summary_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    policies = list(report["summary"])
    header = ["metric", *policies]
    body = [
        [metric.label, *(format_cell(metric, report["summary"][p][metric.name]) for p in policies)]
        for metric in METRICS
        if any(report["summary"][p][metric.name]["value"] is not None for p in policies)
    ]
    body.append(["Runs (seeds)", *(str(report["summary"][p]["requests"]["n_runs"]) for p in policies)])
    return header, body


def render_table(report: dict[str, Any]) -> str:
    header, body = summary_rows(report)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines) + "\n" + _footnote(report) + "\n"


def render_markdown(report: dict[str, Any], with_runs: bool) -> str:
    header, body = summary_rows(report)
    out = [f"# Summary: {report['experiment']}", "", *_md_table(header, body), "", _footnote(report)]
    if with_runs:
        columns = ["run_id", "policy", "seed", "requests", "errors", "followups", "hit_rate",
                   "avoidable_misses", "redirects", "latency_p50", "latency_p95", "imbalance",
                   "moved_share"]  # fmt: skip
        runs = [[_plain(run[c]) for c in columns] for run in report["runs"]]
        out += ["", "## Runs", "", *_md_table(columns, runs)]
    return "\n".join(out) + "\n"


def _footnote(report: dict[str, Any]) -> str:
    return (
        f"Pooled over runs; [min–max] across runs. Hit = follow-up turn with cache_n >= "
        f"{report['hit_share']:g} x the previous turn's prompt tokens. Definitions: "
        f"extproc/analysis/metrics.py."
    )


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
