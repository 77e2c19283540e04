"""Router mode's table: per policy, model loads, cached share and p95 TTFT, mean ± sd over seeds.

Loads come from each run's ``run.json`` (``extra.model_loads``: the simulated replicas' loads);
the cached share and p95 TTFT from its records, as the shared analysis computes them
(``extproc.analysis.metrics.per_run``).
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean, stdev
from typing import Any

from extproc.analysis.metrics import connect, per_run
from extproc.records import read_run_metadata

COLUMNS = (("model_loads", "model loads", 1.0, "{:.1f}"), ("cached_share", "cached share %", 100.0, "{:.1f}"),
           ("ttft_p95", "p95 TTFT s", 1.0, "{:.2f}"))


def loads_table(out_dir: Path, policies: list[str]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """{policy: {column: (mean, sd, runs)}}, policies in the order given (sd 0 for a single run)."""
    runs = per_run(connect(out_dir))
    table = {}
    for policy in policies:
        mine = [run for run in runs if run["policy"] == policy]
        for run in mine:
            run["model_loads"] = read_run_metadata(out_dir / run["run_id"]).extra.get("model_loads", 0)
        table[policy] = {name: _spread([run[name] for run in mine if run[name] is not None])
                         for name, _, _, _ in COLUMNS}
    return table


def _spread(values: list[Any]) -> tuple[float, float, int]:
    xs = [float(value) for value in values]
    if not xs:
        return float("nan"), float("nan"), 0
    return fmean(xs), stdev(xs) if len(xs) > 1 else 0.0, len(xs)


def render_loads(table: dict[str, dict[str, tuple[float, float, int]]]) -> str:
    """The table in Markdown: mean ± sd over seeds."""
    header = ["policy", *(f"{title} (mean ± sd)" for _, title, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy, row in table.items():
        cells = [f"{form.format(row[name][0] * scale)} ± {form.format(row[name][1] * scale)}"
                 for name, _, scale, form in COLUMNS]
        lines.append("| " + " | ".join([policy, *cells]) + " |")
    return "\n".join(lines)
