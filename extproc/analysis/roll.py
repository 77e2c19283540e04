"""What a rolling restart (`llm-ring run --roll-at`) or a scale-in (`--scale-in-at`) cost: the
follow-ups of the conversations whose replica left, and latency around it.

A conversation is *rolled* when its last turn sent before replica R left the lists (run.json
extra.roll[].out) was served by R; its first turn sent after that is its *follow-up*, a hit when
cache_n >= 0.5 x the previous turn's prompt tokens (the report's definition). "Around the roll"
is from 5 s before the first replica left to 5 s after the last one was back (a scale-in: down).
Each follow-up that missed gets a cause: `migrated` (its decision says +migrated, yet the cache
was not there), `early` (sent before its replica was drained and migrated), `not moved` (after).
``during_drain``: the follow-ups sent while their replica drained (between out and drained),
their hits, and how many went to the leaving replica itself.

    python -m extproc.analysis.roll DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from extproc.analysis.metrics import DEFAULT_HIT_SHARE
from extproc.records import read_records

MARGIN_S = 5.0


def roll_figures(run_dir: Path) -> dict[str, Any]:
    meta = json.loads((run_dir / "run.json").read_text())
    roll = meta.get("extra", {}).get("roll") or {}
    steps = roll.get("replicas", [])
    rows = sorted(read_records(run_dir / "requests.parquet").to_pylist(), key=lambda r: r["started_at"])
    outs = {s["replica"]: datetime.fromisoformat(s.get("out", s["down"])) for s in steps}
    last: dict[str, dict[str, Any]] = {}
    drained = {s["replica"]: datetime.fromisoformat(s.get("drained", s["down"])) for s in steps}
    follow_ups, hits = 0, 0
    misses = {"migrated": 0, "early": 0, "not moved": 0}
    during = {"follow_ups": 0, "hits": 0, "on_leaving": 0}  # sent while their replica drained
    rolled: set[str] = set()
    for row in rows:
        conversation = row["conversation"]
        previous = last.get(conversation)
        if (previous is not None and conversation not in rolled and previous["replica"] in outs
                and previous["started_at"] <= outs[previous["replica"]] < row["started_at"]):
            rolled.add(conversation)
            follow_ups += 1
            before = (previous["prompt_n"] or 0) + (previous["cache_n"] or 0)
            hit = (row["cache_n"] or 0) >= DEFAULT_HIT_SHARE * before
            hits += hit
            if row["started_at"] < drained[previous["replica"]]:
                during["follow_ups"] += 1
                during["hits"] += hit
                during["on_leaving"] += row["replica"] == previous["replica"]
            if not hit:
                cause = ("migrated" if "+migrated" in (row["route_reason"] or "")
                         else "early" if row["started_at"] < drained[previous["replica"]] else "not moved")
                misses[cause] += 1
        if row["status"] == 200:
            last[conversation] = row
    latencies = []
    if steps:
        begin = min(outs.values()).timestamp() - MARGIN_S
        end = max(datetime.fromisoformat(s.get("up", s["down"])) for s in steps).timestamp() + MARGIN_S
        latencies = sorted(r["latency_s"] for r in rows
                           if r["status"] == 200 and begin <= r["started_at"].timestamp() <= end)
    migrated = [s.get("migration") or {} for s in steps]
    return {
        "run": run_dir.name, "migrate": roll.get("migrate"), "scale_in": bool(roll.get("scale_in")),
        "replicas_rolled": len(steps), "rolled_follow_ups": follow_ups, "follow_up_hits": hits,
        "follow_up_hit_rate": hits / follow_ups if follow_ups else None, "misses": misses,
        "during_drain": during,
        "p95_latency_around_roll_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "requests_around_roll": len(latencies),
        "moved": sum(int(m.get("succeeded", 0)) for m in migrated),
        "slots": sum(int(m.get("slots", 0)) for m in migrated),
        "moved_bytes": sum(int(m.get("bytes", 0)) for m in migrated),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.analysis.roll", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", metavar="DIR", help="an `llm-ring run --out-dir` folder")
    folders = [Path(folder) for folder in parser.parse_args(argv).out_dirs]
    for folder in folders:
        if not folder.is_dir():
            print(f"python -m extproc.analysis.roll: {folder}: no such folder", file=sys.stderr)
            return 2
    runs = [run for folder in folders for run in sorted(folder.iterdir()) if (run / "requests.parquet").exists()]
    if not runs:
        named = ", ".join(map(str, folders))
        print(f"python -m extproc.analysis.roll: no run (a folder with requests.parquet) in {named}", file=sys.stderr)
        return 2
    for run in runs:
        print(json.dumps(roll_figures(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
