"""The analysis: DuckDB SQL over an experiment folder's parquet records.

One module for the CLI (``llm-ring report``), the tests and the notebooks, so a
number means the same thing everywhere. An experiment folder holds one folder per
run, ``<run_id>/requests.parquet`` and ``<run_id>/run.json`` (see
extproc.records).

Definitions (per run; a request is *ok* when status = 200 and error is null):

- follow-up: an ok turn > 1 whose previous turn (same run, same conversation) was ok,
  both with llama.cpp timings (cache_n, prompt_n) recorded.
- hit: a follow-up with ``cache_n >= hit_share x (cache_n + prompt_n of the previous
  turn)``, i.e. most of the history sent last time was found in the cache. The
  default ``hit_share`` = 0.5: a replica without the history only matches the chat
  template's few tokens, the one holding it matches the whole previous prompt.
- miss: a follow-up that is not a hit; miss rate = 1 - hit rate.
- avoidable miss: a miss served on another replica than the previous turn, i.e. the
  history was cached on another replica (misses on the same replica are evictions).
- redirect (away from the cache): a follow-up served on another replica than the
  previous turn, hit or not.
- cached share: prompt tokens the replicas found in their cache (cache_n) / all prompt tokens
  (cache_n + prompt_n), over ok requests with timings.
- work imbalance: prompt tokens processed (sum of prompt_n) on the busiest replica
  divided by the average over the replicas that served the run.
- prediction error: over ok requests with both the router's predicted_cached_tokens and
  the replica's cache_n, the mean absolute error |predicted - cache_n| in tokens, and the
  share predicted within 10 % of the prompt (|predicted - cache_n| <= 0.1 x (cache_n +
  prompt_n)). Pooled over seeds: summed errors over summed requests.
- after scale-up: for each conversation whose previous turn started before the new
  replica was ready and whose next turn started after it, that next turn. Hit rate
  after scale-up = share of those turns that hit; moved share = share of them served
  on another replica than before.

Pooled over seeds: rates are pooled counts (sum of hits / sum of follow-ups),
latency and TTFT quantiles are over all ok requests of all runs, counts and the
imbalance are means per run. The spread across runs (min, max, a 95% t-interval of
the per-run values) comes with every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from extproc.records import REQUESTS_FILE, RUN_FILE, SPEEDS_FILE

DEFAULT_HIT_SHARE = 0.5


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    kind: str  # pct | count | seconds | ratio


# Order and labels of the summary table.
METRICS: tuple[Metric, ...] = (
    Metric("hit_rate", "Cache hit rate (follow-up turns)", "pct"),
    Metric("miss_rate", "Cache miss rate", "pct"),
    Metric("cached_share", "Cached share of prompt tokens", "pct"),
    Metric("avoidable_misses", "Avoidable misses (history cached elsewhere) per run", "count"),
    Metric("avoidable_share", "Avoidable share of misses", "pct"),
    Metric("redirects", "Redirects away from the cache per run", "count"),
    Metric("latency_p50", "p50 latency", "seconds"),
    Metric("latency_p95", "p95 latency", "seconds"),
    Metric("ttft_p50", "p50 TTFT", "seconds"),
    Metric("ttft_p95", "p95 TTFT", "seconds"),
    Metric("imbalance", "Work imbalance (busiest / average prompt tokens)", "ratio"),
    Metric("prediction_mae", "Cached tokens prediction error (mean |predicted - cache_n|)", "count"),
    Metric("prediction_within_10", "Predictions within 10 % of the prompt", "pct"),
    Metric("after_scale_hit_rate", "Hit rate right after the scale-up", "pct"),
    Metric("moved_share", "Conversations moved by the scale-up", "pct"),
    Metric("requests", "Requests per run", "count"),
    Metric("errors", "Errors per run", "count"),
)


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


def format_cell(metric: Metric, stats: Mapping[str, Any]) -> str:
    """The mean over runs ± the 95 % interval's half-width (one run: its value)."""
    if stats["mean"] is None:
        return "-"
    mean = stats["mean"]
    cell = "-" + format_value(metric, -mean) if mean < 0 else format_value(metric, mean)  # paired differences
    return cell if stats["ci95"] is None else f"{cell} ± {format_value(metric, stats['ci95'])}"


# Two-sided 95% Student t quantiles by degrees of freedom (n_runs - 1); 1.96 beyond.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip

_RUN_COLUMNS = {
    "run_id": "VARCHAR",
    "started_at": "TIMESTAMPTZ",
    "scale_ready_at": "TIMESTAMPTZ",
    "scale_at_s": "DOUBLE",
    "replicas_start": "BIGINT",
    "scaled_to": "BIGINT",
    "status": "VARCHAR",
}

_TURNS = """
CREATE OR REPLACE TEMP VIEW turns AS
WITH ordered AS (
    SELECT r.*,
        status = 200 AND error IS NULL AS ok,
        lag(turn) OVER w AS prev_turn,
        lag(replica) OVER w AS prev_replica,
        lag(cache_n + prompt_n) OVER w AS prev_prompt_tokens,
        lag(status = 200 AND error IS NULL) OVER w AS prev_ok,
        lag(started_at) OVER w AS prev_started_at
    FROM requests r
    WINDOW w AS (PARTITION BY run_id, conversation ORDER BY turn)
), flagged AS (
    SELECT *,
        coalesce(ok AND turn > 1 AND prev_turn = turn - 1 AND prev_ok
            AND cache_n IS NOT NULL AND prev_prompt_tokens IS NOT NULL, false) AS followup
    FROM ordered
)
SELECT f.*,
    followup AND cache_n >= $hit_share * prev_prompt_tokens AS hit,
    followup AND replica IS DISTINCT FROM prev_replica AS redirected,
    followup AND ru.scale_ready_at IS NOT NULL
        AND prev_started_at < ru.scale_ready_at AND started_at >= ru.scale_ready_at AS after_scale,
    epoch(started_at - min(started_at) OVER (PARTITION BY run_id)) AS t_s,
    CASE WHEN ok AND cache_n IS NOT NULL AND predicted_cached_tokens IS NOT NULL
        THEN abs(predicted_cached_tokens - cache_n) END AS prediction_error,
    CASE WHEN ok AND cache_n IS NOT NULL AND predicted_cached_tokens IS NOT NULL
        THEN abs(predicted_cached_tokens - cache_n) <= 0.1 * (cache_n + coalesce(prompt_n, 0)) END
        AS predicted_within_10
FROM flagged f LEFT JOIN (SELECT run_id, scale_ready_at FROM runs) ru USING (run_id)
"""

_PER_RUN = """
WITH work AS (
    SELECT run_id, replica, sum(prompt_n) AS tokens
    FROM turns WHERE ok AND replica IS NOT NULL GROUP BY run_id, replica
), balance AS (
    SELECT run_id, max(tokens) / nullif(avg(tokens), 0) AS imbalance FROM work GROUP BY run_id
)
SELECT run_id, any_value(policy) AS policy, any_value(seed) AS seed,
    any_value(simulated) AS simulated,
    count(*) AS requests,
    count(*) FILTER (NOT ok) AS errors,
    count(*) FILTER (followup) AS followups,
    count(*) FILTER (hit) AS hits,
    count(*) FILTER (hit) / nullif(count(*) FILTER (followup), 0) AS hit_rate,
    1 - count(*) FILTER (hit) / nullif(count(*) FILTER (followup), 0) AS miss_rate,
    count(*) FILTER (followup AND NOT hit) AS misses,
    sum(cache_n) FILTER (ok) AS cached_tokens,
    sum(cache_n + prompt_n) FILTER (ok) AS timed_prompt_tokens,
    sum(cache_n) FILTER (ok) / nullif(sum(cache_n + prompt_n) FILTER (ok), 0) AS cached_share,
    count(*) FILTER (followup AND NOT hit AND redirected) AS avoidable_misses,
    count(*) FILTER (followup AND NOT hit AND redirected)
        / nullif(count(*) FILTER (followup AND NOT hit), 0) AS avoidable_share,
    count(*) FILTER (redirected) AS redirects,
    quantile_cont(latency_s, 0.5) FILTER (ok) AS latency_p50,
    quantile_cont(latency_s, 0.95) FILTER (ok) AS latency_p95,
    quantile_cont(ttft_s, 0.5) FILTER (ok) AS ttft_p50,
    quantile_cont(ttft_s, 0.95) FILTER (ok) AS ttft_p95,
    any_value(b.imbalance) AS imbalance,
    count(prediction_error) AS predictions,
    sum(prediction_error) AS prediction_error_sum,
    count(*) FILTER (predicted_within_10) AS predictions_within_10,
    avg(prediction_error) AS prediction_mae,
    count(*) FILTER (predicted_within_10) / nullif(count(prediction_error), 0) AS prediction_within_10,
    count(*) FILTER (after_scale) AS after_scale_turns,
    count(*) FILTER (after_scale AND hit) / nullif(count(*) FILTER (after_scale), 0)
        AS after_scale_hit_rate,
    count(*) FILTER (after_scale AND redirected) / nullif(count(*) FILTER (after_scale), 0)
        AS moved_share
FROM turns LEFT JOIN balance b USING (run_id)
GROUP BY run_id
ORDER BY policy, seed, run_id
"""

# Pooled per policy: ratios of summed counts, quantiles over all requests, means of per-run counts.
_POOLED = """
WITH q AS (
    SELECT policy,
        quantile_cont(latency_s, [0.5, 0.95]) FILTER (ok) AS lat,
        quantile_cont(ttft_s, [0.5, 0.95]) FILTER (ok) AS ttft
    FROM turns GROUP BY policy
)
SELECT p.policy,
    sum(hits) / nullif(sum(followups), 0) AS hit_rate,
    1 - sum(hits) / nullif(sum(followups), 0) AS miss_rate,
    sum(cached_tokens) / nullif(sum(timed_prompt_tokens), 0) AS cached_share,
    avg(avoidable_misses) AS avoidable_misses,
    sum(avoidable_misses) / nullif(sum(misses), 0) AS avoidable_share,
    avg(redirects) AS redirects,
    any_value(q.lat[1]) AS latency_p50, any_value(q.lat[2]) AS latency_p95,
    any_value(q.ttft[1]) AS ttft_p50, any_value(q.ttft[2]) AS ttft_p95,
    avg(imbalance) AS imbalance,
    sum(prediction_error_sum) / nullif(sum(predictions), 0) AS prediction_mae,
    sum(predictions_within_10) / nullif(sum(predictions), 0) AS prediction_within_10,
    sum(after_scale_hit_rate * after_scale_turns) / nullif(sum(after_scale_turns), 0)
        AS after_scale_hit_rate,
    sum(moved_share * after_scale_turns) / nullif(sum(after_scale_turns), 0) AS moved_share,
    avg(requests) AS requests,
    avg(errors) AS errors,
    count(*) AS n_runs
FROM per_run p JOIN q USING (policy)
GROUP BY p.policy
ORDER BY p.policy
"""


def connect(experiment_dir: str | Path, hit_share: float = DEFAULT_HIT_SHARE) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with views ``requests``, ``runs``, ``turns`` and ``per_run``."""
    root = Path(experiment_dir)
    parquet = requests_files(root)
    if not 0 < hit_share <= 1:
        raise ValueError(f"hit_share must be in (0, 1] (got {hit_share})")
    con = duckdb.connect()
    # by name: records written before a column was added read it as null
    con.execute(f"CREATE TEMP VIEW requests AS SELECT * FROM read_parquet({_sql_list(parquet)}, union_by_name = true)")
    _create_runs_view(con, sorted(root.glob(f"*/{RUN_FILE}")))
    # DuckDB views cannot take parameters, so the hit share is inlined as a checked float.
    con.execute(_TURNS.replace("$hit_share", repr(float(hit_share))))
    con.execute(f"CREATE TEMP VIEW per_run AS {_PER_RUN}")
    return con


def requests_files(experiment_dir: str | Path) -> list[Path]:
    """The folder's ``*/requests.parquet``, sorted; FileNotFoundError when there is none."""
    root = Path(experiment_dir)
    parquet = sorted(root.glob(f"*/{REQUESTS_FILE}"))
    if not parquet:
        raise FileNotFoundError(f"{root}: no */{REQUESTS_FILE} (is this an experiment folder?)")
    return parquet


def _create_runs_view(con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    if files:
        columns = "{" + ", ".join(f"'{k}': '{v}'" for k, v in _RUN_COLUMNS.items()) + "}"
        con.execute(f"CREATE TEMP VIEW runs AS SELECT * FROM read_json({_sql_list(files)}, columns = {columns})")
    else:  # a folder without run.json (e.g. hand-made records): no scale-up information
        typed = ", ".join(f"NULL::{v} AS {k}" for k, v in _RUN_COLUMNS.items())
        con.execute(f"CREATE TEMP VIEW runs AS SELECT {typed} WHERE false")


def _sql_list(paths: list[Path]) -> str:
    # Views cannot take prepared parameters: paths are inlined as quoted SQL strings.
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def folder_labels(folders: list[Path]) -> list[str]:
    """Each folder's name, or its whole path where two names clash."""
    names = [folder.name for folder in folders]
    return [name if names.count(name) == 1 else str(folder) for name, folder in zip(names, folders, strict=True)]


def rows(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    result = con.execute(sql, params) if params is not None else con.execute(sql)
    names = [d[0] for d in result.description]
    return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def per_run(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    return rows(con, "SELECT * FROM per_run")


def summary(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str, dict[str, Any]]]:
    """{policy: {metric: {value, mean, ci95, min, max, n_runs}}} (None where not measured)."""
    pooled = {row.pop("policy"): row for row in rows(con, _POOLED)}
    runs = per_run(con)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for policy, values in pooled.items():
        mine = [run for run in runs if run["policy"] == policy]
        out[policy] = {
            metric.name: spread(values[metric.name], [run[metric.name] for run in mine]) for metric in METRICS
        }
    return out


_AGREEMENT = """
SELECT a.policy,
    count(*) AS matched,
    avg((a.replica IS NOT DISTINCT FROM b.replica)::INT) AS same_replica,
    avg(CASE WHEN a.turn = 1 THEN (a.replica IS NOT DISTINCT FROM b.replica)::INT END) AS same_replica_first_turn
FROM read_parquet($a) a
JOIN read_parquet($b) b USING (policy, seed, conversation, turn)
GROUP BY a.policy
ORDER BY a.policy
"""


def decision_agreement(first_dir: str | Path, second_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Per policy: of the requests both folders hold (same policy, seed, conversation, turn),
    the share routed to the same replica, overall and on first turns.

    Live and simulated runs of one profile and seed send the very same conversations, so
    this tells request by request how closely two runs decided alike (a live run repeated
    gives the yardstick: load-aware decisions depend on timing).
    """
    files = {"a": [str(path) for path in requests_files(first_dir)],
             "b": [str(path) for path in requests_files(second_dir)]}
    return {row.pop("policy"): row for row in rows(duckdb.connect(), _AGREEMENT, files)}


# the metrics paired by seed (`llm-ring sim`'s policies, `llm-ring report`'s folders)
PAIRED = ("hit_rate", "cached_share", "redirects", "latency_p50", "latency_p95", "ttft_p50", "ttft_p95", "imbalance")


def paired_differences(runs: list[dict[str, Any]], columns: list[str],
                       column_of: Callable[[dict[str, Any]], str] = lambda run: run["policy"],
                       ) -> dict[str, dict[str, dict[str, Any]]]:
    """Per column after the first: per-seed (column - first column) of the PAIRED metrics, with a
    95 % CI; a run's column is ``column_of(run)`` (its policy unless told).

    The same seed means the same conversations for every column, so differences cancel
    the seed-to-seed variation that widens the per-column intervals.
    """
    if len(columns) < 2:
        return {}
    by = {(column_of(run), run["seed"]): run for run in runs}
    out = {}
    for column in columns[1:]:
        out[f"{column} - {columns[0]}"] = {
            metric.name: spread(None, [
                by[(column, seed)][metric.name] - base[metric.name]
                for (name, seed), base in by.items()
                if name == columns[0] and (column, seed) in by
                and None not in (base[metric.name], by[(column, seed)][metric.name])
            ]) if metric.name in PAIRED else {"mean": None, "ci95": None, "n_runs": 0}
            for metric in METRICS
        }
    for stats in out.values():
        stats["requests"]["n_runs"] = stats["hit_rate"]["n_runs"]
    return out


def spread(value: Any, per_run_values: list[Any]) -> dict[str, Any]:
    xs = [float(x) for x in per_run_values if x is not None]
    n = len(xs)
    mean = sum(xs) / n if n else None
    ci95 = None
    if n >= 2 and mean is not None:
        sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
        ci95 = _t95(n - 1) * sd / n**0.5
    return {
        "value": None if value is None else float(value),
        "mean": mean,
        "ci95": ci95,
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
        "n_runs": n,
    }


def _t95(df: int) -> float:
    known = [k for k in _T95 if k <= df]
    return _T95[max(known)] if df <= 30 else 1.96


def hit_rate_over_time(con: duckdb.DuckDBPyConnection, bin_s: float) -> list[dict[str, Any]]:
    """Per policy and time bin (seconds since each run's first request): follow-ups and hit rate."""
    return rows(
        con,
        """
        SELECT policy, floor(t_s / $bin) * $bin AS t_s,
            count(*) AS followups, avg(hit::INT) AS hit_rate
        FROM turns WHERE followup
        GROUP BY ALL ORDER BY policy, t_s
        """,
        {"bin": bin_s},
    )


def scale_marks(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Per policy: mean seconds from a run's first request to the new replica being ready."""
    return rows(
        con,
        """
        WITH starts AS (SELECT run_id, policy, min(started_at) AS first FROM requests GROUP BY ALL)
        SELECT policy, avg(epoch(ru.scale_ready_at - s.first)) AS ready_s
        FROM starts s JOIN runs ru USING (run_id)
        WHERE ru.scale_ready_at IS NOT NULL GROUP BY policy ORDER BY policy
        """,
    )


def latency_quantiles(con: duckdb.DuckDBPyConnection, column: str = "latency_s") -> list[dict]:
    """Per policy: the 1st..99th percentiles of ok requests' latency (or ttft_s): a CDF."""
    if column not in ("latency_s", "ttft_s"):
        raise ValueError(f"column must be latency_s or ttft_s (got {column!r})")
    return rows(
        con,
        f"""
        WITH q AS (
            SELECT policy, quantile_cont({column}, [x / 100 FOR x IN range(1, 100)]) AS qs
            FROM turns WHERE ok AND {column} IS NOT NULL GROUP BY policy
        )
        SELECT policy, unnest(range(1, 100)) AS percentile, unnest(qs) AS seconds
        FROM q ORDER BY policy, percentile
        """,
    )


def route_reasons(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Per policy and route reason: decisions per run (why the router chose what it chose)."""
    return rows(
        con,
        """
        WITH n AS (SELECT policy, count(DISTINCT run_id) AS runs FROM turns GROUP BY policy)
        SELECT policy, coalesce(route_reason, '?') AS route_reason,
            count(*) / any_value(n.runs) AS per_run
        FROM turns JOIN n USING (policy) GROUP BY ALL ORDER BY policy, route_reason
        """,
    )



def speeds_files(experiment_dir: str | Path) -> list[Path]:
    """The folder's runs that recorded the router's learnt replica speeds, llm-aware's first (the
    policy that decides on them; the others keep the prior speed)."""
    files = Path(experiment_dir).glob(f"*/{SPEEDS_FILE}")
    return sorted(files, key=lambda path: ("llm-aware" not in path.parent.name, path))


def longest_run_s(con: duckdb.DuckDBPyConnection) -> float:
    """Seconds from a run's first request to its last start, the longest run's."""
    return float(rows(con, "SELECT coalesce(max(t_s), 0) AS longest FROM turns")[0]["longest"])


def learnt_speeds(con: duckdb.DuckDBPyConnection, speeds_file: Path, bin_s: float) -> list[dict[str, Any]]:
    """Per replica and time bin of one run: the learnt prefill speed and the true one when alone."""
    return rows(
        con,
        """
        SELECT replica, floor(at_s / $bin) * $bin AS t_s,
            avg(learnt_prefill_tokens_per_s) AS learnt, avg(true_prefill_tokens_per_s) AS solo
        FROM read_parquet($file) GROUP BY ALL ORDER BY ALL
        """,
        {"bin": bin_s, "file": str(speeds_file)},
    )
