"""`llm-ring bench sim [--json]`: how fast the simulator runs the real policies.

Two figures, each against its target:
- simulated requests per second on the standard profile, 3 replicas, every policy
  (the event loop + Router.route/complete; the conversations are generated beforehand);
- wall time for the 3,993-request Mooncake synthetic trace through all five policies
  (parsing and conversation inference included).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from extproc.sim.costmodel import load_cost_model
from extproc.sim.engine import Fleet
from extproc.sim.mooncake import read_trace
from extproc.sim.runs import cache_tokens, load_sim_config, parse_policy, run_once
from extproc.sim.workload import profile_workload, requests_from_trace
from extproc.traffic import load_profile

POLICIES = ("round-robin", "mod-n", "consistent", "bounded", "llm-aware")
SEEDS = (1, 2, 3, 4)
TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
TARGET_REQ_PER_S = 50_000
TARGET_TRACE_S = 10.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE, help=f"Mooncake trace (default {TRACE})")


def main(args: argparse.Namespace) -> int:
    config = load_sim_config()
    cost = load_cost_model(config.cost_model)
    fleet = Fleet(3, config.slots, cache_tokens(config.cache_ram_mib, cost))
    profile = load_profile("standard")
    per_policy = {}
    total_requests, total_s, total_cpu = 0, 0.0, 0.0
    for policy in POLICIES:
        settings = parse_policy(policy, config.routing)
        workloads = [profile_workload(profile, seed) for seed in SEEDS]
        started, cpu = time.perf_counter(), time.process_time()
        requests = sum(len(run_once(w, settings, cost, fleet).requests) for w in workloads)
        elapsed = time.perf_counter() - started
        total_cpu += time.process_time() - cpu
        per_policy[policy] = round(requests / elapsed)
        total_requests += requests
        total_s += elapsed
    result: dict = {
        "profile": {"name": "standard", "replicas": 3, "seeds": list(SEEDS), "requests": total_requests,
                    "seconds": round(total_s, 3), "req_per_s": round(total_requests / total_s),
                    "cpu_seconds": round(total_cpu, 3), "req_per_cpu_s": round(total_requests / total_cpu),
                    "req_per_s_by_policy": per_policy, "target_req_per_s": TARGET_REQ_PER_S},
    }
    trace_path = getattr(args, "trace", TRACE)
    if Path(trace_path).exists():
        started, cpu = time.perf_counter(), time.process_time()
        trace = read_trace(trace_path)
        requests = 0
        for policy in POLICIES:
            workload = requests_from_trace(trace, config.time_scale)
            requests += len(run_once(workload, parse_policy(policy, config.routing), cost, fleet).requests)
        elapsed = time.perf_counter() - started
        result["trace"] = {"file": str(trace_path), "requests": requests, "policies": len(POLICIES),
                           "seconds": round(elapsed, 3), "cpu_seconds": round(time.process_time() - cpu, 3),
                           "req_per_s": round(requests / elapsed),
                           "target_seconds": TARGET_TRACE_S}
    if args.json:
        print(json.dumps(result))
    else:
        p = result["profile"]
        print(f"standard profile, 3 replicas, {len(SEEDS)} seeds x {len(POLICIES)} policies: "
              f"{p['requests']} requests in {p['seconds']:.2f} s = {p['req_per_s']:,} simulated req/s "
              f"(target {TARGET_REQ_PER_S:,}); CPU time {p['cpu_seconds']:.2f} s = {p['req_per_cpu_s']:,} req/CPU-s")
        for policy, rate in per_policy.items():
            print(f"  {policy:12s} {rate:>9,} req/s")
        if "trace" in result:
            t = result["trace"]
            print(f"Mooncake trace, {len(POLICIES)} policies: {t['requests']} requests in {t['seconds']:.2f} s "
                  f"(target < {TARGET_TRACE_S:.0f} s); CPU time {t['cpu_seconds']:.2f} s")
        else:
            print(f"Mooncake trace not found at {trace_path}: skipped")
        print("(2 shared cores: wall time includes other processes; run twice, figures are noisy)")
    return 0
