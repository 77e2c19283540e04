"""How long one routing decision takes, per policy and fleet size, and what memory costs.

Drives the real Router with a steady in-flight window (so loads are never all zero),
multi-turn conversations (so placement memory is hit), and times each route() call.
The peer policies (docs/peer-policies.md) run at PEER_FLEET replicas only, on requests
carrying the prefix blocks of a prompt of about 2,000 tokens (a shared system prompt, the
conversation's opening, its turns); hashing those blocks is timed on its own. So does
llm-aware with its prefix index (docs/prefix-index.md), whose bytes per block are measured too.
With the compiled routing core (extproc/compiled.py) the index's figures are also taken from
the same core run as Python, in a child process, pairs alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import extproc
from extproc import compiled
from extproc.bench import against
from extproc.cli_input import UsageError
from extproc.experiments.run import parse_policy
from extproc.routing import POLICIES, PlacementMemory, Router, RouteRequest, make_policy, stable_hash
from extproc.routing.blocks import BLOCK_CHARS, BlockMemory, prefix_blocks
from extproc.routing.policies.llm_aware import INDEX_BLOCK_CHARS
from extproc.routing.prefix_index import PrefixIndex
from extproc.routing.settings import RoutingSettings, with_knobs
from extproc.settings import parse_routing
from extproc.sim.runs import load_sim_config

FLEETS = (3, 16, 64, 1000)
PEER_FLEET = 64
PREFIX_INDEX = "llm-aware:prefix_index=true"  # timed at PEER_FLEET, on the peers' requests
SYSTEM_PROMPTS = tuple(f"System prompt {n}: answer as a careful reviewer. " * 100 for n in range(4))  # 4,700 chars
TARGET_MEDIAN_US = 20.0  # llm-aware at 64 replicas (issue target on 2 cores)
TARGET_BYTES_PER_CONVERSATION = 200.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decisions", type=int, default=20_000, help="timed decisions per cell")
    parser.add_argument("--fleets", type=int, nargs="+", default=list(FLEETS), help="replica counts")
    parser.add_argument("--against", metavar="DIR",
                        help="another llm-ring checkout: every cell timed here and there in alternating pairs, "
                             "the median of the pairs' ratios printed (against.py)")
    parser.add_argument("--rounds", type=int, default=15, help="pairs per cell with --against")


def bench_settings(**knobs: object) -> RoutingSettings:
    """The simulator's settings (sim.toml) in tokens, the prefix index off; the policy (and any
    knob) from ``knobs``."""
    table = with_knobs(load_sim_config().routing, {"policy": "bounded", "load_unit": "tokens"})
    table = with_knobs(table, {"policy": "llm-aware", "prefix_index": False})
    return parse_routing(with_knobs(table, knobs))


def prompt_text(slot: int, conversation: int, turn: int) -> str:
    """About 1,350 to 2,100 tokens: a shared system prompt, the conversation's opening, its turns."""
    opening = f"conversation {slot}-{conversation}: " * 40
    return SYSTEM_PROMPTS[slot % len(SYSTEM_PROMPTS)] + opening + "".join(f"turn {t}: " * 40 for t in range(turn))


def time_decisions(spec: str, replicas: int, decisions: int) -> dict[str, float]:
    """``spec``: a policy name, or name:key=value,... (the runners' syntax)."""
    knobs = parse_policy(spec).routing
    router = Router(bench_settings(**knobs), [f"llm-{i}" for i in range(replicas)])
    block_chars = router.policy.prefix_block_chars
    rng = random.Random(1)
    conversations = max(50, replicas * 8)
    turns = [0] * conversations
    requests = []
    for index in range(decisions):
        slot = rng.randrange(conversations)
        turns[slot] += 1  # a slot's conversation ends after 10 turns and a new one starts
        conversation, turn = divmod(turns[slot], 10)
        requests.append((str(index), slot, conversation, turn, 100 + 150 * turn + rng.randrange(50)))
    window = replicas * 4  # requests in flight at any time
    samples = []
    clock = time.perf_counter_ns
    route, complete = router.route, router.complete
    for request_id, slot, conversation, turn, prompt in requests:
        name = f"conversation-{slot}-{conversation}"
        key = router.conversation_key(name)
        if block_chars:  # built outside the timed call: the blocks and the key arrive with the request
            text = prompt_text(slot, conversation, turn)
            request = RouteRequest(request_id, name, len(text) // 4, 64, prefix_blocks(text, block_chars), key=key)
        else:
            request = RouteRequest(request_id, name, prompt, 64, key=key)
        start = clock()
        route(request)
        samples.append(clock() - start)
        if int(request_id) >= window:
            complete(str(int(request_id) - window))
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1000,
        "p99_us": samples[int(len(samples) * 0.99)] / 1000,
    }


def block_hashing_us(block_chars: int, repeats: int = 2_000) -> tuple[int, int, float]:
    """(prompt tokens, blocks, median µs) of prefix_blocks() on a 9-turn prompt."""
    text = prompt_text(1, 0, 9)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        prefix_blocks(text, block_chars)
        samples.append(time.perf_counter_ns() - start)
    return len(text) // 4, len(prefix_blocks(text, block_chars)), statistics.median(samples) / 1000


def next_turn_hashing_us(block_chars: int, repeats: int = 2_000) -> float:
    """Median µs of the service's BlockMemory on the same 9-turn prompt after its 8-turn one."""
    earlier, text = prompt_text(1, 0, 8), prompt_text(1, 0, 9)
    samples = []
    for number in range(repeats):
        memory = BlockMemory(block_chars)
        memory.blocks(str(number), earlier)
        start = time.perf_counter_ns()
        memory.blocks(str(number), text)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def index_figures(decisions: int) -> dict[str, float]:
    """The index at PEER_FLEET replicas: its median decision, the hashing of a first and of a next turn."""
    return {"median_us": time_decisions(PREFIX_INDEX, PEER_FLEET, decisions)["median_us"],
            "hashing_us": block_hashing_us(INDEX_BLOCK_CHARS)[2],
            "next_turn_us": next_turn_hashing_us(INDEX_BLOCK_CHARS)}


def compiled_against_python(decisions: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """index_figures with the compiled core (here) and as Python (a child process), ``rounds``
    pairs alternated: medians of each side and the median of the pairs' ratios."""
    code = f"import json, extproc.bench.decisions as d; print(json.dumps(d.index_figures({decisions})))"
    child = {**os.environ, compiled.ENV: "python"}
    pairs = []
    for _ in range(rounds):
        here = index_figures(decisions)
        done = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, check=True)
        pairs.append((here, json.loads(done.stdout)))
    return {name: {"compiled": statistics.median(a[name] for a, _ in pairs),
                   "python": statistics.median(b[name] for _, b in pairs),
                   "ratio": statistics.median(a[name] / b[name] for a, b in pairs)} for name in pairs[0][0]}


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


def bytes_per_block(replicas: int = 8, prompts: int = 400) -> float:
    """Bytes per block held by a prefix index filled to capacity (2,000-token prompts of 16-token blocks:
    the bytes go with the number of blocks, not their size)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(5_000 * 16)
    for number in range(prompts):
        text = prompt_text(number % 4, number, 9)
        index.add_prompt(f"llm-{number % replicas}", prefix_blocks(text, BLOCK_CHARS), 16)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / sum(index.size(f"llm-{n}") for n in range(replicas))


def main(args: argparse.Namespace) -> int:
    decisions = getattr(args, "decisions", 20_000)
    fleets = getattr(args, "fleets", list(FLEETS))
    other = against.checkout(args.against) if getattr(args, "against", None) else None  # checked before any output
    if other is not None and args.rounds < 1:
        raise UsageError(f"--rounds: {args.rounds} is not a positive number of pairs")
    if not args.json:
        print(f"  routing core: {compiled.describe(extproc.CORE)}", flush=True)
    if other is not None:
        return compare(args, other, decisions, fleets)
    summary = summarize(time_cells(fleets, decisions, show=not args.json), decisions)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0


def time_cells(fleets: Sequence[int], decisions: int, show: bool) -> list[dict[str, Any]]:
    """Each cell's decision times, and its median against round-robin's on the same fleet."""
    results: list[dict[str, Any]] = []
    floor: dict[int, float] = {}  # round-robin's median per fleet: what this machine charges for any decision
    for policy, replicas in bench_cells(fleets):
        cell = time_decisions(policy, replicas, decisions)
        floor.setdefault(replicas, cell["median_us"])
        cell["x_round_robin"] = cell["median_us"] / floor[replicas]
        results.append({"policy": policy, "replicas": replicas, **cell})
        if show:
            print(f"  {policy:<15} {replicas:>5} replicas  median {cell['median_us']:6.1f} µs"
                  f"  p99 {cell['p99_us']:7.1f} µs  {cell['x_round_robin']:5.2f}× round-robin", flush=True)
    return results


def summarize(results: list[dict[str, Any]], decisions: int) -> dict[str, Any]:
    """The cells with the figures around them: hashing, memory per conversation and per block,
    the targets (and compiled against Python when the core is compiled)."""
    hashed_tokens, peer_blocks, peer_hashing_us = block_hashing_us(BLOCK_CHARS)
    _, index_blocks, hashing_us = block_hashing_us(INDEX_BLOCK_CHARS)
    next_turn_us = next_turn_hashing_us(INDEX_BLOCK_CHARS)
    memory_bytes = bytes_per_conversation()
    block_bytes = bytes_per_block()
    target = next((r for r in results if r["policy"] == "llm-aware" and r["replicas"] == 64), None)
    indexed = next(r for r in results if r["policy"] == PREFIX_INDEX)
    return {
        "core": extproc.CORE,
        "compiled_against_python": compiled_against_python(decisions) if extproc.CORE == "compiled" else None,
        "decisions": results,
        "bytes_per_remembered_conversation": memory_bytes,
        "block_hashing": {"prompt_tokens": hashed_tokens,
                          "prefix_index": {"block_chars": INDEX_BLOCK_CHARS, "blocks": index_blocks,
                                           "median_us": hashing_us, "next_turn_median_us": next_turn_us},
                          "peers": {"block_chars": BLOCK_CHARS, "blocks": peer_blocks, "median_us": peer_hashing_us}},
        "bytes_per_prefix_index_block": block_bytes,
        "prefix_index_64_median_us": indexed["median_us"],
        "llm_aware_64_median_us": target["median_us"] if target else None,
        "targets": {"llm_aware_64_median_us": TARGET_MEDIAN_US,
                    "bytes_per_remembered_conversation": TARGET_BYTES_PER_CONVERSATION},
    }


def print_summary(summary: dict[str, Any]) -> None:
    hashing = summary["block_hashing"]
    index, peers = hashing["prefix_index"], hashing["peers"]
    hashing_us, next_turn_us = index["median_us"], index["next_turn_median_us"]
    print(f"\n  prefix blocks of a {hashing['prompt_tokens']}-token prompt: {hashing_us:.1f} µs to hash for the index "
          f"({index['blocks']} blocks of {INDEX_BLOCK_CHARS} characters), {peers['median_us']:.1f} µs for the peers "
          f"({peers['blocks']} of {BLOCK_CHARS}); {next_turn_us:.1f} µs for the index when the turn before was "
          f"hashed (only its new blocks)")
    decided = summary["prefix_index_64_median_us"]
    print(f"  {PREFIX_INDEX} at {PEER_FLEET} replicas: median {decided:.1f} µs + hashing {hashing_us:.1f} µs = "
          f"{decided + hashing_us:.1f} µs, a next turn {decided + next_turn_us:.1f} µs (target ≤ "
          f"{TARGET_MEDIAN_US:.0f} µs, ratio {(decided + hashing_us) / TARGET_MEDIAN_US:.2f}); "
          f"{summary['bytes_per_prefix_index_block']:.0f} bytes per indexed block")
    if (versus := summary["compiled_against_python"]) is not None:
        print(f"  the same, compiled against Python (3 pairs alternated): decision {_versus(versus['median_us'])}, "
              f"hashing {_versus(versus['hashing_us'])}, a next turn's {_versus(versus['next_turn_us'])}")
    memory_bytes = summary["bytes_per_remembered_conversation"]
    print(f"  placement memory: {memory_bytes:.0f} bytes per remembered conversation "
          f"(target ≤ {TARGET_BYTES_PER_CONVERSATION:.0f}, ratio {memory_bytes / TARGET_BYTES_PER_CONVERSATION:.2f})")
    if (target_us := summary["llm_aware_64_median_us"]) is not None:
        print(f"  llm-aware at 64 replicas: median {target_us:.1f} µs "
              f"(target ≤ {TARGET_MEDIAN_US:.0f} µs, ratio {target_us / TARGET_MEDIAN_US:.2f})")


def bench_cells(fleets: Sequence[int]) -> list[tuple[str, int]]:
    """(policy, replicas) of each timed cell: ours at each fleet, the peers and the index at PEER_FLEET."""
    cells = [(policy, replicas) for policy in POLICIES if not _peer(policy) for replicas in fleets]
    return cells + [(policy, PEER_FLEET) for policy in POLICIES if _peer(policy)] + [(PREFIX_INDEX, PEER_FLEET)]


def compare(args: argparse.Namespace, other: Path, decisions: int, fleets: Sequence[int]) -> int:
    """--against DIR: every cell here and in ``other``, in alternating pairs (against.py)."""
    here = Path(extproc.__file__).resolve().parent.parent
    show = None if args.json else (lambda row: print(against.render_row(row), flush=True))
    if show is not None:
        print(f"  against {other} (its core chosen by the same {compiled.ENV}), {args.rounds} pairs per cell "
              f"over {min(against.PROCESSES, args.rounds)} pairs of workers, {decisions:,} decisions each: the "
              f"median of the pairs' ratios (here / there) and their range", flush=True)
    cells = [(policy, replicas, decisions) for policy, replicas in bench_cells(fleets)]
    rows = against.paired_cells(here, other, cells, args.rounds, show)
    slower = [row for row in rows if row.get("ratio", 0) > against.SLOWER_THAN]
    if args.json:
        print(json.dumps({"core": extproc.CORE, "against": str(other), "rounds": args.rounds, "cells": rows}))
    else:
        compared = sum("ratio" in row for row in rows)
        named = ", ".join(f"{row['policy']} at {row['replicas']}" for row in slower)
        print(f"  {compared - len(slower)} of {compared} cells within 5 % of {other}"
              + (f"; slower: {named}" if slower else ""))
    return 0


def _versus(figures: dict[str, float]) -> str:
    return f"{figures['compiled']:.1f} against {figures['python']:.1f} µs ({figures['ratio']:.2f}×)"


def _peer(policy: str) -> bool:
    settings = bench_settings(policy=policy)
    return make_policy(settings, settings.replicas).prefix_block_chars > 0
