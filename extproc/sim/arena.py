"""The arena table for a trace: how much of the cacheable prompt each policy's fleet reused, at what latency.

Per run (one policy, one seed), from the experiment folder's records (SQL over the shared
analysis views), then mean ± 95 % t-interval over the seeds:

- cached share: prompt tokens the replicas found in their cache / all prompt tokens
  (requests answered; a refused one has no prompt processed);
- share of the ceiling: cached share / the trace's infinite-cache ceiling
  (``mooncake.cacheable_ceiling``: the share an infinite cache shared by all would hit);
- avoidable misses, p50/p95 TTFT and latency, work imbalance, errors: the shared analysis' definitions;
- decisions per run by reason code (why each policy went where it went), and the cached
  share of the prompt tokens of each reason's requests (what each kind of decision kept).

A trace without block hashes has no cached share and no ceiling: the table says so.
"""

from __future__ import annotations

from typing import Any

import duckdb

from extproc.analysis.metrics import Metric, per_run, rows, spread

NO_BLOCKS = "n/a: trace has no block hashes"

CACHED = Metric("cached_share", "Cached share of prompt tokens", "pct")
OF_CEILING = Metric("ceiling_share", "Share of the infinite-cache ceiling", "pct")
SHARED = (
    Metric("avoidable_misses", "Avoidable misses (history cached elsewhere) per run", "count"),
    Metric("ttft_p50", "p50 TTFT", "seconds"),
    Metric("ttft_p95", "p95 TTFT", "seconds"),
    Metric("latency_p50", "p50 latency", "seconds"),
    Metric("latency_p95", "p95 latency", "seconds"),
    Metric("imbalance", "Work imbalance (busiest / average prompt tokens)", "ratio"),
    Metric("errors", "Errors per run (context too long)", "count"),
)

_PER_RUN = """
SELECT run_id,
    sum(cache_n) FILTER (ok) / nullif(sum(cache_n + prompt_n) FILTER (ok), 0) AS cached_share
FROM turns GROUP BY run_id
"""

_REASONS = """
SELECT run_id, route_reason AS reason, count(*) AS n,
    sum(cache_n) FILTER (ok) / nullif(sum(cache_n + prompt_n) FILTER (ok), 0) AS cached_share
FROM turns GROUP BY run_id, route_reason
"""


def arena(
    con: duckdb.DuckDBPyConnection, policies: list[str], ceiling: float | None
) -> tuple[list[Metric], dict[str, dict[str, dict[str, Any]]]]:
    """(rows of the table, {policy: {metric: spread over seeds}}), policies in the order given."""
    runs = per_run(con)
    cached = {row["run_id"]: row["cached_share"] for row in rows(con, _PER_RUN)}
    reasons: dict[str, dict[str, Any]] = {}  # run -> {"reason:code": count, "cached:code": share}
    for row in rows(con, _REASONS):
        code = row["reason"] or "none"
        counts = reasons.setdefault(row["run_id"], {})
        counts[f"reason:{code}"], counts[f"cached:{code}"] = row["n"], row["cached_share"]
    codes = sorted({key.partition(":")[2] for counts in reasons.values() for key in counts})
    metrics = [CACHED, OF_CEILING, *SHARED] if ceiling is not None else list(SHARED)
    metrics += [Metric(f"reason:{code}", f"decisions '{code}' per run", "count") for code in codes]
    if ceiling is not None:
        metrics += [Metric(f"cached:{code}", f"cached share of prompt tokens on '{code}'", "pct") for code in codes]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for policy in policies:
        mine = [run for run in runs if run["policy"] == policy]
        values: dict[str, list[Any]] = {metric.name: [] for metric in metrics}
        for run in mine:
            share = cached.get(run["run_id"])
            for metric in metrics:
                if metric is CACHED:
                    value = share
                elif metric is OF_CEILING:
                    value = None if share is None or not ceiling else share / ceiling
                elif metric.name.startswith("reason:"):
                    value = reasons.get(run["run_id"], {}).get(metric.name, 0)
                elif metric.name.startswith("cached:"):
                    value = reasons.get(run["run_id"], {}).get(metric.name)
                else:
                    value = run[metric.name]
                values[metric.name].append(value)
        table[policy] = {name: spread(None, xs) for name, xs in values.items()}
        table[policy]["requests"] = spread(None, [run["requests"] for run in mine])
    return metrics, table


def ceiling_line(ceiling: float | None) -> str:
    if ceiling is None:
        return f"infinite-cache ceiling: {NO_BLOCKS} (cached share cannot be computed)"
    return f"infinite-cache ceiling (prompt tokens an infinite shared cache would hit): {100 * ceiling:.1f}%"
