# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %%
# The experiment folders to read (`--out-dir` of `llm-ring run` or `llm-ring sim`). A relative
# path is relative to the repository root, wherever the kernel runs. Several folders are shown
# side by side (a live run and its simulation, say). LLM_RING_EXPERIMENT_DIRS, folders separated
# by ":", replaces this list when set (the notebook test sets it).
FOLDERS = ["results/quick-sim"]
BIN_S = 5.0  # width of the hit-rate-over-time bins, seconds

# %% [markdown]
# # Policy comparison
#
# Reads the folders above through the shared SQL in `extproc.analysis.metrics`, so every
# number here is the one `llm-ring report` prints for the same folders. Every chart is
# aggregated in DuckDB first (Altair refuses more than 5,000 rows).

# %%
import os

import altair as alt

from extproc.analysis.metrics import (
    METRICS,
    connect,
    hit_rate_over_time,
    latency_quantiles,
    route_reasons,
    scale_marks,
)
from extproc.analysis.report import build_report, combine, folder_labels, render_markdown, resolve_folders

if os.environ.get("LLM_RING_EXPERIMENT_DIRS"):
    FOLDERS = os.environ["LLM_RING_EXPERIMENT_DIRS"].split(":")
folders = resolve_folders(FOLDERS)
labels = folder_labels(folders)
connections = {label: connect(folder) for label, folder in zip(labels, folders, strict=True)}


def series(label: str, policy: str) -> str:
    """A chart's colour: the policy, prefixed by the folder when there are several."""
    return policy if len(folders) == 1 else f"{label}: {policy}"


def collected(query) -> list[dict]:
    """``query(con)``'s rows from every folder, each with its series name."""
    return [
        dict(row, series=series(label, row["policy"])) for label, con in connections.items() for row in query(con)
    ]


# %% [markdown]
# ## Summary per policy (mean over seeds ± 95% interval)

# %%
report = combine(folders, [build_report(folder) for folder in folders])
print(render_markdown(report, with_runs=False))

# %%
shown = ("hit_rate", "avoidable_share", "latency_p95", "imbalance")
names = {m.name: m.label for m in METRICS}
bars = [
    {"series": column, "metric": names[name], "mean": s["mean"],
     "low": s["mean"] - (s["ci95"] or 0), "high": s["mean"] + (s["ci95"] or 0)}
    for column, metrics in report["summary"].items()
    for name, s in metrics.items()
    if name in shown and s["mean"] is not None
]  # fmt: skip
base = alt.Chart(alt.Data(values=bars)).encode(y=alt.Y("series:N", title=None))
(
    alt.layer(
        base.mark_bar().encode(x=alt.X("mean:Q", title=None), color="series:N"),
        base.mark_rule().encode(x="low:Q", x2="high:Q"),
    )
    .properties(width=260, height=70)
    .facet(facet=alt.Facet("metric:N", title=None), columns=2)
    .resolve_scale(x="independent")
)

# %% [markdown]
# ## Hit rate over time (all seeds pooled), new replica ready marked

# %%
over_time = collected(lambda con: hit_rate_over_time(con, BIN_S))
marks = collected(scale_marks)
lines = (
    alt.Chart(alt.Data(values=over_time))
    .mark_line(point=True)
    .encode(
        x=alt.X("t_s:Q", title="seconds since the run's first request"),
        y=alt.Y("hit_rate:Q", title="follow-up hit rate", scale=alt.Scale(domain=[0, 1])),
        color="series:N",
        tooltip=["series:N", "t_s:Q", "hit_rate:Q", "followups:Q"],
    )
)
rules = (
    alt.Chart(alt.Data(values=marks))
    .mark_rule(strokeDash=[4, 4])
    .encode(x="ready_s:Q", color="series:N", tooltip=["series:N", "ready_s:Q"])
)
(lines + rules if marks else lines).properties(width=560, height=260)

# %% [markdown]
# ## Latency and TTFT distributions (percentiles of ok requests, all seeds pooled)

# %%
cdf = [dict(row, measure="latency") for row in collected(lambda con: latency_quantiles(con, "latency_s"))]
cdf += [dict(row, measure="TTFT") for row in collected(lambda con: latency_quantiles(con, "ttft_s"))]
(
    alt.Chart(alt.Data(values=cdf))
    .mark_line()
    .encode(
        x=alt.X("seconds:Q", scale=alt.Scale(type="log"), title="seconds (log)"),
        y=alt.Y("percentile:Q"),
        color="series:N",
    )
    .properties(width=260, height=220)
    .facet(column=alt.Column("measure:N", title=None))
)

# %% [markdown]
# ## Why the router chose what it chose (decisions per run)

# %%
(
    alt.Chart(alt.Data(values=collected(route_reasons)))
    .mark_bar()
    .encode(x="per_run:Q", y=alt.Y("series:N", title=None), color="route_reason:N")
    .properties(width=560, height=30 * len(report["summary"]))
)

# %% [markdown]
# ## Learnt replica speeds against the true ones (simulated runs with `speeds.parquet`)
#
# The router learns each replica's prefill speed from its answers' timings alone
# (docs/policies.md); dashed: the replica's true speed when alone (its cost model, slowed by
# `llm-ring sim --slow`). One run per folder: the first llm-aware run that wrote speeds. The
# learnt figure is the speed under the replica's usual load, so it sits below the solo one.

# %%
speed_rows = []
for label, folder in zip(labels, folders, strict=True):
    runs = sorted(folder.glob("*llm-aware*/speeds.parquet"))
    if runs:
        speed_rows += [
            dict(row, series=f"{label}: {runs[0].parent.name}")
            for row in connections[label]
            .execute(
                "SELECT replica, floor(at_s / $bin) * $bin AS t_s, avg(learnt_prefill_tokens_per_s) AS learnt,"
                " avg(true_prefill_tokens_per_s) AS solo FROM read_parquet($file) GROUP BY ALL ORDER BY ALL",
                {"bin": BIN_S, "file": str(runs[0])},
            )
            .df()
            .to_dict("records")
        ]
if speed_rows:
    speed_base = alt.Chart(alt.Data(values=speed_rows)).encode(
        x=alt.X("t_s:Q", title="simulated seconds"), color="replica:N"
    )
    # shown explicitly: inside an `if` the chart is not the cell's last expression
    (
        speed_base.mark_line().encode(y=alt.Y("learnt:Q", title="prefill tokens/s", scale=alt.Scale(type="log")))
        + speed_base.mark_line(strokeDash=[4, 4]).encode(y="solo:Q")
    ).properties(width=560, height=260).facet(row=alt.Row("series:N", title=None)).display()
else:
    print("no speeds.parquet in these folders (llm-ring sim writes them for llm-aware)")
