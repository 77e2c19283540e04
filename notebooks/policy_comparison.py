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
BIN_S = None  # width of the time bins in seconds; None: a round width, at most 24 bins over the longest run

# %% [markdown]
# # Policy comparison
#
# Reads the folders above through the shared SQL in `extproc.analysis.metrics`, so every
# number here is the one `llm-ring report` prints for the same folders, and draws the very
# charts `llm-ring report --charts/--html` writes (`extproc.analysis.charts`, one definition
# of each).

# %%
import os

from extproc.analysis.charts import figures, open_sources
from extproc.analysis.report import build_report, combine, render_markdown, resolve_folders

if os.environ.get("LLM_RING_EXPERIMENT_DIRS"):
    FOLDERS = os.environ["LLM_RING_EXPERIMENT_DIRS"].split(":")
folders = resolve_folders(FOLDERS)
report = combine(folders, [build_report(folder) for folder in folders])
drawn = figures(open_sources(folders), report["summary"], BIN_S)


def show(name: str) -> None:
    """One figure, or why these folders have none."""
    if name in drawn:
        print(drawn[name].title)
        drawn[name].chart.display()
    else:
        print(f"no {name} chart: these folders have no data for it")


# %% [markdown]
# ## Summary per policy (mean over seeds ± 95% interval)

# %%
print(render_markdown(report, with_runs=False))

# %%
show("summary")

# %% [markdown]
# ## Hit rate over time (all seeds pooled), new replica ready marked

# %%
show("hit_rate_over_time")

# %% [markdown]
# ## Latency and TTFT distributions (percentiles of ok requests, all seeds pooled)

# %%
show("latency_ttft")

# %% [markdown]
# ## Why the router chose what it chose (decisions per run)

# %%
show("route_reasons")

# %% [markdown]
# ## Learnt replica speeds against the true ones (simulated runs with `speeds.parquet`)
#
# The router learns each replica's prefill speed from its answers' timings alone
# (docs/policies.md); dashed: the replica's true speed when alone (its cost model, slowed by
# `llm-ring sim --slow`). One run per folder: the first llm-aware run that wrote speeds. The
# learnt figure is the speed under the replica's usual load, so it sits below the solo one.

# %%
show("learnt_speeds")
