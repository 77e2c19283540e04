"""How long one routing decision takes, per policy and fleet size, and what memory costs.

Drives the real Router with a steady in-flight window (so loads are never all zero),
multi-turn conversations (so placement memory is hit), and times each route() call.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc

from extproc.routing import POLICIES, PlacementMemory, Router, RouteRequest, stable_hash
from extproc.settings import parse_routing

FLEETS = (3, 16, 64, 1000)
TARGET_MEDIAN_US = 20.0  # llm-aware at 64 replicas (issue target on 2 cores)
TARGET_BYTES_PER_CONVERSATION = 200.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decisions", type=int, default=20_000, help="timed decisions per cell")
    parser.add_argument("--fleets", type=int, nargs="+", default=list(FLEETS), help="replica counts")


def bench_settings(policy: str):
    return parse_routing({
        "policy": policy, "virtual_nodes": 100, "hash_seed": 0, "epsilon": 0.25,
        "load_unit": "tokens", "cache_aware": True, "placement_memory": True,
        "long_stickiness": True, "long_prompt_tokens": 800, "long_load_factor": 2.0,
        "memory_capacity": 1_000_000,
    })


def time_decisions(policy: str, replicas: int, decisions: int) -> dict[str, float]:
    router = Router(bench_settings(policy), [f"llm-{i}" for i in range(replicas)])
    rng = random.Random(1)
    conversations = max(50, replicas * 8)
    turns = [0] * conversations
    requests = []
    for index in range(decisions):
        slot = rng.randrange(conversations)
        turns[slot] += 1  # a slot's conversation ends after 10 turns and a new one starts
        conversation, turn = divmod(turns[slot], 10)
        prompt = 100 + 150 * turn + rng.randrange(50)
        requests.append(RouteRequest(str(index), f"conversation-{slot}-{conversation}", prompt, 64))
    window = replicas * 4  # requests in flight at any time
    samples = []
    clock = time.perf_counter_ns
    route, complete = router.route, router.complete
    for index, request in enumerate(requests):
        start = clock()
        route(request)
        samples.append(clock() - start)
        if index >= window:
            complete(str(index - window))
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1000,
        "p99_us": samples[int(len(samples) * 0.99)] / 1000,
    }


def bytes_per_conversation(conversations: int = 200_000) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    memory = PlacementMemory(conversations * 2)
    for index in range(conversations):
        key = stable_hash(f"a0b1c2d3-conversation-{index:012d}")
        memory.remember(key, f"llm-{index % 64}", 100 + index % 4000)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / conversations


def main(args: argparse.Namespace) -> int:
    decisions = getattr(args, "decisions", 20_000)
    fleets = getattr(args, "fleets", list(FLEETS))
    results = []
    floor: dict[int, float] = {}  # round-robin's median per fleet: what this machine charges for any decision
    for policy in POLICIES:
        for replicas in fleets:
            cell = time_decisions(policy, replicas, decisions)
            floor.setdefault(replicas, cell["median_us"])
            cell["x_round_robin"] = cell["median_us"] / floor[replicas]
            results.append({"policy": policy, "replicas": replicas, **cell})
            if not args.json:
                print(f"  {policy:<12} {replicas:>5} replicas  median {cell['median_us']:6.1f} µs"
                      f"  p99 {cell['p99_us']:7.1f} µs  {cell['x_round_robin']:5.2f}× round-robin", flush=True)
    memory_bytes = bytes_per_conversation()
    target = next((r for r in results if r["policy"] == "llm-aware" and r["replicas"] == 64), None)
    summary = {
        "decisions": results,
        "bytes_per_remembered_conversation": memory_bytes,
        "llm_aware_64_median_us": target["median_us"] if target else None,
        "targets": {"llm_aware_64_median_us": TARGET_MEDIAN_US,
                    "bytes_per_remembered_conversation": TARGET_BYTES_PER_CONVERSATION},
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"\n  placement memory: {memory_bytes:.0f} bytes per remembered conversation "
          f"(target ≤ {TARGET_BYTES_PER_CONVERSATION:.0f}, ratio {memory_bytes / TARGET_BYTES_PER_CONVERSATION:.2f})")
    if target:
        print(f"  llm-aware at 64 replicas: median {target['median_us']:.1f} µs "
              f"(target ≤ {TARGET_MEDIAN_US:.0f} µs, ratio {target['median_us'] / TARGET_MEDIAN_US:.2f})")
    return 0
