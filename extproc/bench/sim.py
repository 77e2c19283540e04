"""`llm-ring bench sim [--json] [--rounds N]`: how fast the simulator runs the real policies.

Two figures, each against its target:
- simulated requests per second on the standard profile, 3 replicas, every policy
  (the event loop + Router.route/complete; the conversations are generated beforehand);
- wall time for the 3,993-request Mooncake synthetic trace through every registered policy
  (parsing and conversation inference included), at its recorded pace on 8 replicas of the
  paged H100 model (the arena's setting).

One pass over the profile takes under half a second here, and these shared 2-core machines
change speed from one second to the next (the same code measured 33k-48k simulated req/s in
five passes a minute apart). So every policy first runs once untimed (warm-up: allocator,
caches), then all policies are timed --rounds times, and each figure is the median over the
rounds, printed with its range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from extproc.routing.policies import REGISTRY as REGISTERED
from extproc.routing.settings import RoutingSettings
from extproc.sim.costmodel import CostModel, load_cost_model
from extproc.sim.engine import ClosedLoop, Fleet
from extproc.sim.mooncake import jittered_arrivals, read_trace
from extproc.sim.runs import load_sim_config, parse_policy, run_once
from extproc.sim.workload import profile_workload, requests_from_trace
from extproc.traffic import load_profile

POLICIES = ("round-robin", "mod-n", "consistent", "bounded", "llm-aware")
SEEDS = (1, 2, 3, 4)
TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
TARGET_REQ_PER_S = 50_000
TARGET_TRACE_S = 15.0  # for nine policies
TRACE_COST_MODEL = "llama31-8b-h100-vllm"
TRACE_REPLICAS = 8


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE, help=f"Mooncake trace (default {TRACE})")
    parser.add_argument("--rounds", type=int, default=5, help="timed passes (after one warm-up); medians shown")


def main(args: argparse.Namespace) -> int:
    result = run(max(1, int(getattr(args, "rounds", 5))), Path(getattr(args, "trace", TRACE)))
    print(json.dumps(result) if getattr(args, "json", False) else render(result))
    return 0


def run(rounds: int, trace_path: Path) -> dict[str, Any]:
    config = load_sim_config()
    cost = load_cost_model(config.cost_model)
    fleet = config.fleet(3, cost)
    profile = load_profile("standard")
    workloads = {policy: [profile_workload(profile, seed) for seed in SEEDS] for policy in POLICIES}
    settings = {policy: parse_policy(policy, config.routing) for policy in POLICIES}
    for policy in POLICIES:  # warm-up, untimed
        run_once(workloads[policy][0], settings[policy], cost, fleet)
    passes = []  # per round: policy -> (requests, seconds)
    for _ in range(rounds):
        passes.append({policy: _timed(workloads[policy], settings[policy], cost, fleet) for policy in POLICIES})
    totals = [sum(n for n, _ in p.values()) / sum(s for _, s in p.values()) for p in passes]
    result: dict[str, Any] = {
        "profile": {
            "name": "standard",
            "replicas": 3,
            "seeds": list(SEEDS),
            "rounds": rounds,
            "requests_per_round": sum(n for n, _ in passes[0].values()),
            "req_per_s": round(statistics.median(totals)),
            "req_per_s_min": round(min(totals)),
            "req_per_s_max": round(max(totals)),
            "req_per_s_by_policy": {
                policy: round(statistics.median(p[policy][0] / p[policy][1] for p in passes)) for policy in POLICIES
            },
            "target_req_per_s": TARGET_REQ_PER_S,
        },
    }
    if trace_path.exists():
        assert config.jitter_bucket_s is not None  # load_sim_config requires it
        gpu = load_cost_model(TRACE_COST_MODEL)
        policies = list(REGISTERED)
        started, cpu = time.perf_counter(), time.process_time()
        trace = read_trace(trace_path)
        requests = 0
        fleet = config.fleet(TRACE_REPLICAS, gpu, cache=False)
        for policy in policies:
            workload = requests_from_trace(trace, 1.0, jittered_arrivals(trace, config.jitter_bucket_s, 1))
            requests += len(run_once(workload, parse_policy(policy, config.routing), gpu,
                                     fleet).requests)
        elapsed = time.perf_counter() - started
        result["trace"] = {
            "file": str(trace_path),
            "cost_model": TRACE_COST_MODEL,
            "replicas": TRACE_REPLICAS,
            "requests": requests,
            "policies": policies,
            "seconds": round(elapsed, 3),
            "cpu_seconds": round(time.process_time() - cpu, 3),
            "target_seconds": TARGET_TRACE_S,
        }
    return result


def _timed(workloads: list[ClosedLoop], settings: RoutingSettings, cost: CostModel, fleet: Fleet) -> tuple[int, float]:
    started = time.perf_counter()
    requests = sum(len(run_once(workload, settings, cost, fleet).requests) for workload in workloads)
    return requests, time.perf_counter() - started


def render(result: dict[str, Any]) -> str:
    p = result["profile"]
    verdict = "met" if p["req_per_s"] >= TARGET_REQ_PER_S else "MISSED"
    lines = [
        f"standard profile, 3 replicas, {len(p['seeds'])} seeds x {len(POLICIES)} policies "
        f"({p['requests_per_round']:,} requests a round), median of {p['rounds']} rounds: "
        f"{p['req_per_s']:,} simulated req/s (range {p['req_per_s_min']:,}-{p['req_per_s_max']:,}; "
        f"target {TARGET_REQ_PER_S:,}: {verdict}, ratio {p['req_per_s'] / TARGET_REQ_PER_S:.2f})",
    ]
    lines += [f"  {policy:12s} {rate:>9,} req/s" for policy, rate in p["req_per_s_by_policy"].items()]
    trace = result.get("trace")
    if trace is not None:
        verdict = "met" if trace["seconds"] < TARGET_TRACE_S else "MISSED"
        lines.append(
            f"Mooncake trace at its recorded pace, {trace['replicas']} x {trace['cost_model']}, "
            f"{len(trace['policies'])} registered policies ({' '.join(trace['policies'])}): "
            f"{trace['requests']:,} requests in {trace['seconds']:.2f} s (target < {TARGET_TRACE_S:.0f} s for nine: "
            f"{verdict}, ratio {trace['seconds'] / TARGET_TRACE_S:.2f}); CPU time {trace['cpu_seconds']:.2f} s"
        )
    else:
        lines.append("Mooncake trace not found: skipped (--trace FILE)")
    lines.append("(2 shared cores: other processes slow every figure; the range shows how much)")
    return "\n".join(lines)
