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

# %% [markdown]
# # Policy comparison
#
# Reads one experiment folder (written by `llm-ring run` or `llm-ring sim`) through the
# shared SQL in `extproc.analysis.metrics`, so every number here is the one
# `llm-ring report` prints. Set `LLM_RING_EXPERIMENT_DIR` to the folder. Every chart is
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
    summary,
)
from extproc.analysis.report import build_report, render_markdown

EXPERIMENT = os.environ.get("LLM_RING_EXPERIMENT_DIR")
if not EXPERIMENT:
    raise SystemExit("set LLM_RING_EXPERIMENT_DIR to an experiment folder (llm-ring run --out-dir)")
BIN_S = float(os.environ.get("LLM_RING_BIN_S", "5"))
con = connect(EXPERIMENT)

# %% [markdown]
# ## Summary per policy (pooled over seeds; [min–max] across seeds)

# %%
print(render_markdown(build_report(EXPERIMENT), with_runs=False))

# %%
stats = summary(con)
shown = ("hit_rate", "avoidable_share", "latency_p95", "imbalance")
labels = {m.name: m.label for m in METRICS}
bars = [
    {"policy": policy, "metric": labels[name], "value": s["value"], "low": s["min"], "high": s["max"]}
    for policy, metrics in stats.items()
    for name, s in metrics.items()
    if name in shown and s["value"] is not None
]  # fmt: skip
base = alt.Chart(alt.Data(values=bars)).encode(y=alt.Y("policy:N", title=None))
(
    alt.layer(
        base.mark_bar().encode(x=alt.X("value:Q", title=None), color="policy:N"),
        base.mark_rule().encode(x="low:Q", x2="high:Q"),
    )
    .properties(width=260, height=70)
    .facet(facet=alt.Facet("metric:N", title=None), columns=2)
    .resolve_scale(x="independent")
)

# %% [markdown]
# ## Hit rate over time (all seeds pooled), new replica ready marked

# %%
over_time = hit_rate_over_time(con, BIN_S)
marks = scale_marks(con)
lines = (
    alt.Chart(alt.Data(values=over_time))
    .mark_line(point=True)
    .encode(
        x=alt.X("t_s:Q", title="seconds since the run's first request"),
        y=alt.Y("hit_rate:Q", title="follow-up hit rate", scale=alt.Scale(domain=[0, 1])),
        color="policy:N",
        tooltip=["policy:N", "t_s:Q", "hit_rate:Q", "followups:Q"],
    )
)
rules = (
    alt.Chart(alt.Data(values=marks))
    .mark_rule(strokeDash=[4, 4])
    .encode(x="ready_s:Q", color="policy:N", tooltip=["policy:N", "ready_s:Q"])
)
(lines + rules if marks else lines).properties(width=560, height=260)

# %% [markdown]
# ## Latency and TTFT distributions (percentiles of ok requests)

# %%
cdf = [dict(row, measure="latency") for row in latency_quantiles(con, "latency_s")]
cdf += [dict(row, measure="TTFT") for row in latency_quantiles(con, "ttft_s")]
(
    alt.Chart(alt.Data(values=cdf))
    .mark_line()
    .encode(
        x=alt.X("seconds:Q", scale=alt.Scale(type="log"), title="seconds (log)"),
        y=alt.Y("percentile:Q"),
        color="policy:N",
    )
    .properties(width=260, height=220)
    .facet(column=alt.Column("measure:N", title=None))
)

# %% [markdown]
# ## Why the router chose what it chose (decisions per run)

# %%
(
    alt.Chart(alt.Data(values=route_reasons(con)))
    .mark_bar()
    .encode(x="per_run:Q", y=alt.Y("policy:N", title=None), color="route_reason:N")
    .properties(width=560, height=90)
)
