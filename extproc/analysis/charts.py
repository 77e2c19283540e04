"""The report's figures, each defined once: `llm-ring report --charts/--html`, `llm-ring demo`
and the notebook all draw them from here, out of the same DuckDB queries as the tables
(extproc/analysis/metrics.py).

Building a chart is pure: rows in, an Altair chart out. ``figures`` runs the queries. Every
chart carries its rows inline, aggregated in DuckDB first (Altair refuses more than 5,000
rows), so one spec renders the same in vl-convert (PNG, SVG), a browser and a notebook.
A series is a policy, or ``folder: policy`` when several folders sit side by side (the
table's column names), and keeps its colour in every chart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import duckdb

from extproc.analysis.metrics import (
    DEFAULT_HIT_SHARE,
    METRICS,
    connect,
    folder_labels,
    format_cell,
    hit_rate_over_time,
    latency_quantiles,
    learnt_speeds,
    longest_run_s,
    route_reasons,
    scale_marks,
    speeds_files,
)

BINS = 24  # time bins over the longest run, each a round number of seconds
_ROUND_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
# the original study's summary.png: hit rate, p95 latency and imbalance per policy
SUMMARY_METRICS = ("hit_rate", "latency_p95", "imbalance")
_AXIS_FORMAT = {"pct": ".0%", "seconds": ".3~s", "ratio": ".2f", "count": "~s"}
WIDTH = 560

Rows = list[dict[str, Any]]
Stats = Mapping[str, Mapping[str, Mapping[str, Any]]]  # {series: {metric: spread}} (a report's summary)


@dataclass(frozen=True)
class Figure:
    name: str  # the file's name without its suffix
    title: str
    chart: alt.TopLevelMixin


@dataclass(frozen=True)
class Source:
    """One experiment folder as the figures read it."""

    label: str  # its name in a series (folder_labels)
    path: Path
    con: duckdb.DuckDBPyConnection  # metrics.connect(path, hit_share)


def open_sources(folders: Sequence[Path], hit_share: float = DEFAULT_HIT_SHARE) -> list[Source]:
    """The folders, labelled as the report labels them (``folder_labels``)."""
    return [Source(label, folder, connect(folder, hit_share))
            for label, folder in zip(folder_labels(list(folders)), folders, strict=True)]


def series_name(label: str, policy: str, several: bool) -> str:
    """A series: the policy, prefixed by its folder when several folders are shown (report.side_by_side)."""
    return f"{label}: {policy}" if several else policy


def time_bin(longest_s: float, bins: int = BINS) -> float:
    """The smallest round width that cuts ``longest_s`` into at most ``bins`` bins."""
    return float(next((width for width in _ROUND_S if width * bins >= longest_s), _ROUND_S[-1]))


def figures(sources: Sequence[Source], summary: Stats, bin_s: float | None = None) -> dict[str, Figure]:
    """Every figure the folders have data for, by name; ``summary``: the report's (its columns
    are the series); ``bin_s``: the time bins' width (default: ``time_bin`` of the longest run)."""
    several = len(sources) > 1
    bin_s = bin_s or time_bin(max(longest_run_s(s.con) for s in sources))

    def collected(query: Callable[[duckdb.DuckDBPyConnection], Rows]) -> Rows:
        return [dict(row, series=series_name(s.label, row["policy"], several)) for s in sources for row in query(s.con)]

    order = list(summary)
    cdf = [dict(row, measure="latency") for row in collected(lambda con: latency_quantiles(con, "latency_s"))]
    cdf += [dict(row, measure="TTFT") for row in collected(lambda con: latency_quantiles(con, "ttft_s"))]
    speeds = [
        dict(row, series=f"{s.label}: {files[0].parent.name}")
        for s in sources
        if (files := speeds_files(s.path))
        for row in learnt_speeds(s.con, files[0], bin_s)
    ]
    over_time, marks = collected(lambda con: hit_rate_over_time(con, bin_s)), collected(scale_marks)
    scaled = "; dashed: the new replica ready" if marks else ""
    drawn = [
        Figure("summary", "Hit rate, p95 latency and imbalance per policy (mean over seeds ± 95 % interval)",
               summary_chart(summary)),
        Figure("hit_rate_over_time", "Hit rate over time (all seeds pooled)" + scaled,
               hit_rate_chart(over_time, marks, order)) if over_time else None,
        Figure("latency_ttft", "Latency and TTFT distributions (ok requests, all seeds pooled)",
               distributions_chart(cdf, order)) if cdf else None,
        Figure("route_reasons", "Why the router chose what it chose (decisions per run)",
               reasons_chart(collected(route_reasons), order)),
        Figure("learnt_speeds", "Learnt replica speeds against the true ones (one run per folder)",
               speeds_chart(speeds)) if speeds else None,
    ]  # fmt: skip
    return {figure.name: figure for figure in drawn if figure is not None}


def _series_colour(order: Sequence[str], legend: bool = True) -> alt.Color:
    colour = alt.Color("series:N", title=None, scale=alt.Scale(domain=list(order)), sort=list(order))
    return colour if legend else colour.legend(None)


def summary_chart(summary: Stats) -> alt.TopLevelMixin:
    """Per series, each of SUMMARY_METRICS: the mean over runs as a bar, its 95 % interval as a
    rule, and the table's cell as text."""
    order, metrics = list(summary), {metric.name: metric for metric in METRICS}
    panels = []
    for name in SUMMARY_METRICS:
        metric = metrics[name]
        bars = [
            {"series": series, "mean": s["mean"], "low": s["mean"] - (s["ci95"] or 0),
             "high": s["mean"] + (s["ci95"] or 0), "cell": format_cell(metric, s)}
            for series, by_metric in summary.items()
            if (s := by_metric[name])["mean"] is not None
        ]  # fmt: skip
        base = alt.Chart(alt.Data(values=bars)).encode(y=alt.Y("series:N", title=None, sort=order))
        x = alt.X("mean:Q", title=None, axis=alt.Axis(format=_AXIS_FORMAT[metric.kind]))
        panels.append(
            alt.layer(
                base.mark_bar().encode(x=x, color=_series_colour(order, legend=False),
                                       tooltip=["series:N", "cell:N"]),
                base.mark_rule(size=2).encode(x="low:Q", x2="high:Q"),
                base.mark_text(align="left", dx=4, fontSize=12).encode(x="high:Q", text="cell:N"),
            ).properties(title=metric.label, width=WIDTH - 160, height=30 * len(order))
        )
    return alt.vconcat(*panels, spacing=24).resolve_scale(x="independent")


def hit_rate_chart(over_time: Rows, marks: Rows, order: Sequence[str]) -> alt.TopLevelMixin:
    """Follow-up hit rate per time bin, one line per series; dashed: when the new replica was ready."""
    lines = (
        alt.Chart(alt.Data(values=over_time))
        .mark_line(point=True)
        .encode(
            x=alt.X("t_s:Q", title="seconds since the run's first request"),
            y=alt.Y("hit_rate:Q", title="follow-up hit rate", scale=alt.Scale(domain=[0, 1]),
                    axis=alt.Axis(format=".0%")),
            color=_series_colour(order),
            tooltip=["series:N", "t_s:Q", alt.Tooltip("hit_rate:Q", format=".1%"), "followups:Q"],
        )
    )  # fmt: skip
    rules = (
        alt.Chart(alt.Data(values=marks))
        .mark_rule(strokeDash=[4, 4])
        .encode(x="ready_s:Q", color=_series_colour(order), tooltip=["series:N", "ready_s:Q"])
    )
    return (lines + rules if marks else lines).properties(width=WIDTH, height=260)


def distributions_chart(cdf: Rows, order: Sequence[str]) -> alt.TopLevelMixin:
    """Percentiles 1..99 of latency and TTFT (rows with ``measure``), one line per series."""
    return (
        alt.Chart(alt.Data(values=cdf))
        .mark_line()
        .encode(
            x=alt.X("seconds:Q", scale=alt.Scale(type="log"), title="seconds (log)"),
            y=alt.Y("percentile:Q"),
            color=_series_colour(order),
            tooltip=["series:N", "percentile:Q", alt.Tooltip("seconds:Q", format=".3f")],
        )
        .properties(width=WIDTH // 2 - 20, height=220)
        .facet(column=alt.Column("measure:N", title=None, sort=["latency", "TTFT"]))
    )


def reasons_chart(reasons: Rows, order: Sequence[str]) -> alt.TopLevelMixin:
    """Decisions per run, one stacked bar per series, coloured by route reason."""
    return (
        alt.Chart(alt.Data(values=reasons))
        .mark_bar()
        .encode(
            x=alt.X("per_run:Q", title="decisions per run"),
            y=alt.Y("series:N", title=None, sort=list(order)),
            color=alt.Color("route_reason:N", title="reason"),
            tooltip=["series:N", "route_reason:N", alt.Tooltip("per_run:Q", format=".1f")],
        )
        .properties(width=WIDTH, height=30 * len(order))
    )


def speeds_chart(speeds: Rows) -> alt.TopLevelMixin:
    """The router's learnt prefill speed of each replica over time; dashed: the true one alone
    (its cost model, slowed by `llm-ring sim --slow`). One row per run."""
    base = alt.Chart(alt.Data(values=speeds)).encode(
        x=alt.X("t_s:Q", title="simulated seconds"), color=alt.Color("replica:N")
    )
    return (
        alt.layer(
            base.mark_line().encode(
                y=alt.Y("learnt:Q", title="prefill tokens/s (log)", scale=alt.Scale(type="log")),
                tooltip=["replica:N", "t_s:Q", alt.Tooltip("learnt:Q", format=".0f")],
            ),
            base.mark_line(strokeDash=[4, 4]).encode(y="solo:Q"),
        )
        .properties(width=WIDTH, height=220)
        .facet(row=alt.Row("series:N", title=None))
    )
