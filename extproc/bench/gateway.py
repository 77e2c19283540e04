"""`llm-ring bench gateway`: what Envoy and the routing service add to each request.

Side by side in one run, against the same trivial upstream (extproc.bench.stub_upstream,
3 ports = 3 "replicas"): direct, Envoy alone (the same rendered config without ext_proc),
Envoy + a do-nothing Python ext_proc server speaking the same protocol (the floor any Python
grpc.aio ext_proc pays: extproc.bench.stub_processor), Envoy + ext_proc (`llm-ring serve`,
llm-aware policy, route_decision logs to a file), and with --store on also Envoy + ext_proc
sharing its state through a private redis-server (store.url set: one store round trip before
each decision, writes pipelined; docs/several-gateways.md), and with --tokenizer on also Envoy +
ext_proc counting tokens with the model's own tokenizer and chat template (service.tokenizer =
the SmolLM2 GGUF file; the others count characters / 4), and with --flow on also Envoy + ext_proc
with flow control on (docs/flow-control.md) and slots enough that nothing waits: the cost of the
queue on the path of a request routed at once. At each
concurrency, closed-loop keep-alive clients send chat requests for a fixed time; the table
shows p50/p99 latency, req/s, and the latency ext_proc adds over Envoy alone, then the CPU
time each process spent per request (from /proc: less moved by other work on a busy machine
than latency, so it is the figure to compare between runs and changes).
Rounds: every cell is measured --rounds times, the modes alternating within each round (in
reverse order every other round), and each figure is the median over the rounds (these machines
are noisy: a burst of other work then spoils one round of every mode alike instead of one
mode's only measurement).
Everything shares this machine's cores: the client's own cost is in every column alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from extproc.bench.gateway_load import WARMUP_SECONDS, cpu_seconds, load
from extproc.bench.side_by_side import render_side_by_side, run_side_by_side
from extproc.bench.stubs import (
    FLOW_ENV,
    ROOM_ENV,
    ServiceOnStubs,
    flow_outcomes,
    room_of,
    start_service_on_stubs,
    start_stub_picker,
    start_stub_processor,
    start_variant_service,
)
from extproc.envoy.contract import split_host_port
from extproc.service.dataplanes.own_envoy_config import flow_options
from extproc.service.dataplanes.picker_gateways import AI_GATEWAY
from extproc.settings import load_settings
from extproc.stack.processes import (
    ROUTER_REFERENCE,
    Running,
    free_port,
    service_env,
    start_gateway_envoy,
    start_inference_gateway_envoy,
    start_picker_service,
    start_service,
    static_discovery,
)
from extproc.stack.redis_server import password_file, redis_server_binary, start_redis, user_url

TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 5.0
TARGET_RPS = 1500.0
BUSY_LOAD_PER_CPU = 0.5  # a 1-minute load average above this per CPU at the start: other work shares the cores
MODES = ("direct", "envoy", "envoy+stub_ext_proc", "envoy+ext_proc")
FULL = MODES[3]  # the service, which the variants below are measured against
STORE_MODE = "envoy+ext_proc+store"
TOKENIZER_MODE = "envoy+ext_proc+tokenizer"
FLOW_MODE = "envoy+ext_proc+flow"
# --mode pool: the same through an InferencePool gateway's data plane (Envoy AI Gateway's,
# full duplex, the picker over TLS; extproc.service.dataplanes.picker_gateways), with its own floor:
# a do-nothing TLS picker answering every phase (extproc.bench.stub_picker)
POOL_FLOOR = "pool+stub_picker"
POOL_MODE = "pool+ext_proc"
POOL_MODES = (POOL_FLOOR, POOL_MODE)
VARIANT_MODES = (STORE_MODE, TOKENIZER_MODE, FLOW_MODE)  # the service with one thing changed


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="client connections per cell")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured time per cell (after 0.5 s warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per cell, modes alternating; medians shown")
    parser.add_argument("--conversations", type=int, default=200, help="distinct x-conversation-id values")
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    parser.add_argument("--mode", nargs="+", choices=["own", "pool"], default=["own"],
                        help="own: through the gateway's own Envoy configuration (always measured); pool: also "
                             "through an InferencePool gateway's (Envoy AI Gateway's data plane, full duplex, TLS "
                             "to the picker); `--mode own pool` measures both in one run, each against its floor")
    parser.add_argument("--store", nargs="+", choices=["off", "on"], default=["off"],
                        help="ext_proc without (off) and/or with (on) the shared store: on starts a private "
                             "redis-server; `--store on off` measures both in one run")
    parser.add_argument("--tokenizer", nargs="+", choices=["off", "on"], default=["off"],
                        help="ext_proc counting characters / 4 (off) and/or with the model's tokenizer and chat "
                             "template (on: the SmolLM2 GGUF file); `--tokenizer off on` measures both in one run")
    parser.add_argument("--flow", nargs="+", choices=["off", "on"], default=["off"],
                        help="ext_proc without (off) and/or with (on) flow control, nothing waiting; "
                             "`--flow off on` measures both in one run")
    parser.add_argument("--paced", type=float, metavar="RATE",
                        help="with --flow off on: measure the two side by side instead (side_by_side.py), each "
                             "service sent RATE requests a second, with an identical service as the noise; "
                             "--rounds sets of fresh services, --seconds per window")


def main(args: argparse.Namespace) -> int:
    if "on" in getattr(args, "store", ()) and redis_server_binary() is None:
        print("llm-ring bench gateway: --store on needs redis-server (`make setup` installs Debian's package)",
              file=sys.stderr)
        return 2
    paced = getattr(args, "paced", None)
    if paced is not None and (paced <= 0 or set(getattr(args, "flow", ())) != {"off", "on"}):
        print("llm-ring bench gateway: --paced RATE takes a positive rate, with --flow off on", file=sys.stderr)
        return 2
    result = run(args) if paced is None else run_side_by_side(args)
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        print(render_table(result) if paced is None else render_side_by_side(result))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    concurrency = list(getattr(args, "concurrency", [1, 8, 32]))
    seconds = float(getattr(args, "seconds", 2.0))
    rounds = max(1, int(getattr(args, "rounds", 3)))
    conversations = int(getattr(args, "conversations", 200))
    with_store = "on" in getattr(args, "store", ())
    with_pool = "pool" in getattr(args, "mode", ("own",))
    with_tokenizer = "on" in getattr(args, "tokenizer", ())
    with_flow = "on" in getattr(args, "flow", ())
    modes = (*MODES, *((STORE_MODE,) if with_store else ()), *((TOKENIZER_MODE,) if with_tokenizer else ()),
             *((FLOW_MODE,) if with_flow else ()), *(POOL_MODES if with_pool else ()))
    load_at_start = os.getloadavg()[0]  # before the benchmark's own processes add theirs
    workdir = Path(tempfile.mkdtemp(prefix="llm-ring-bench-gateway-"))
    started: list[Running] = []
    try:
        stubbed = start_service_on_stubs(workdir, 3, "stub", ROOM_ENV if with_flow else None)
        started += stubbed.processes
        targets = {"direct": [split_host_port(address)[1] for address in stubbed.replicas.values()]}
        processes: dict[str, dict[str, Running]] = {"direct": {}}
        ext_procs = start_ext_procs(workdir, stubbed, modes, started)
        for mode, ext_proc in ext_procs.items():
            processes[mode] = {} if ext_proc is None else {"ext_proc": ext_proc}
            envoy = start_envoy(workdir, mode, ext_proc, stubbed.endpoints, args)
            started.append(envoy)
            targets[mode] = [split_host_port(envoy.listen)[1]]
            processes[mode]["envoy"] = envoy
        if with_pool:
            for mode, pair in start_pool(workdir, stubbed.replicas, args, started).items():
                targets[mode] = [split_host_port(pair["envoy"].listen)[1]]
                processes[mode] = pair
        cells = measure_rounds(modes, targets, processes, concurrency, rounds, seconds, conversations)
        result = summarize(cells, seconds, rounds, str(workdir) if getattr(args, "keep", False) else None,
                           load_at_start)
        if with_store:
            result["store"] = store_health(processes[STORE_MODE]["ext_proc"])
        if with_flow:
            result["flow"] = flow_outcomes(processes[FLOW_MODE]["ext_proc"])
        return result
    finally:
        for running in reversed(started):
            running.stop()
        if not getattr(args, "keep", False):
            shutil.rmtree(workdir, ignore_errors=True)


def start_ext_procs(
    workdir: Path, stubbed: ServiceOnStubs, modes: tuple[str, ...], started: list[Running]
) -> dict[str, Running | None]:
    """The ext_proc behind each Envoy mode (None: Envoy alone), in the order their Envoys start:
    the stub processor, the service, and the service's variants ``modes`` ask for."""
    stub_processor = start_stub_processor(free_port(), stubbed.replicas["stub-0"], workdir / "stub_processor")
    started.append(stub_processor)
    ext_procs: dict[str, Running | None] = {
        "envoy": None, "envoy+stub_ext_proc": stub_processor, "envoy+ext_proc": stubbed.service,
    }
    if STORE_MODE in modes:
        redis_server = start_redis(workdir / "redis")
        started.append(redis_server)
        sharing = start_sharing_service(workdir, stubbed, user_url(redis_server.address),
                                        password_file(workdir / "redis"))
        started.append(sharing)
        ext_procs[STORE_MODE] = sharing
    for mode, settings in ((TOKENIZER_MODE, counting_env), (FLOW_MODE, lambda: FLOW_ENV)):
        if mode in modes:  # the same service with ``settings`` changed
            variant = start_variant_service(workdir, stubbed, mode, settings())
            started.append(variant)
            ext_procs[mode] = variant
    return ext_procs


def start_envoy(
    workdir: Path, mode: str, ext_proc: Running | None, endpoints: Path, args: argparse.Namespace
) -> Running:
    """The Envoy of one mode, in front of ``ext_proc`` (None: routing by itself)."""
    flow = flow_options(load_settings(ROUTER_REFERENCE, environ=FLOW_ENV).flow) if mode == FLOW_MODE else None
    return start_gateway_envoy(workdir / mode, ext_proc.ext_proc if ext_proc else None, endpoints, False,
                               args_envoy_concurrency(args), flow=flow)


def start_pool(
    workdir: Path, replicas: dict[str, str], args: argparse.Namespace, started: list[Running]
) -> dict[str, dict[str, Running]]:
    """The inference-pool modes: an AI gateway's Envoy in front of the stub picker, and of ours."""
    stub_picker = start_stub_picker(free_port(), replicas["stub-0"], workdir / "stub_picker")
    started.append(stub_picker)
    picker = start_picker_service(workdir / "picker", replicas)
    started.append(picker)
    processes: dict[str, dict[str, Running]] = {}
    for mode, running in ((POOL_FLOOR, stub_picker), (POOL_MODE, picker)):
        envoy = start_inference_gateway_envoy(workdir / mode, AI_GATEWAY, running.ext_proc,
                                              sorted(replicas.values()), args_envoy_concurrency(args))
        started.append(envoy)
        processes[mode] = {"envoy": envoy, "ext_proc": running}
    return processes


def measure_rounds(modes: tuple[str, ...], targets: dict[str, list[int]], processes: dict[str, dict[str, Running]],
                   concurrency: list[int], rounds: int, seconds: float, conversations: int) -> list[dict[str, Any]]:
    """Every (mode, concurrency) cell ``rounds`` times, the modes alternating within a round, in
    reverse order every other round (a cell just after a service's is measured while that
    service still reads the access log Envoy flushes it: none always comes second); the medians."""
    measured: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for round_number in range(1, rounds + 1):
        for level in concurrency:
            for mode in modes if round_number % 2 else modes[::-1]:
                cell = measure(targets[mode], processes[mode], level, seconds, conversations)
                measured.setdefault((mode, level), []).append(cell)
                _progress(
                    f"round {round_number}/{rounds} {mode:>19} c={level:<3} p50={cell['p50_ms']:.3f} ms "
                    f"p99={cell['p99_ms']:.3f} ms {cell['rps']:.0f} req/s"
                    + (f" {cell['errors']} errors ({cell['first_error']})" if cell["errors"] else "")
                )
    return [{"mode": mode, "concurrency": level, **median_cell(runs),
             **(round_ratios(runs, measured[(FULL, level)]) if mode in VARIANT_MODES else {})}
            for (mode, level), runs in measured.items()]


def round_ratios(runs: list[dict[str, Any]], full: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's req/s and ext_proc CPU per request over the service's without it, round by round
    (the two measured one right after the other), and the median of each: less moved by the
    machine's drift than the ratio of the medians."""
    pairs = list(zip(runs, full, strict=True))

    def ratios(key: str) -> list[float]:
        return [round(run[key] / without[key], 3) if without[key] else 0.0 for run, without in pairs]

    rps, cpu = ratios("rps"), ratios("ext_proc_cpu_us_per_request")
    return {"rps_ratios": rps, "cpu_ratios": cpu, "rps_ratio": statistics.median(rps),
            "cpu_ratio": statistics.median(cpu)}


def start_sharing_service(workdir: Path, stubbed: ServiceOnStubs, store_url: str, store_password: Path) -> Running:
    """A second `llm-ring serve` over the same stubs, its state shared through ``store_url``."""
    listen = f"127.0.0.1:{free_port()}"
    env = service_env(listen, workdir / "eds-store" / "replicas.json", static_discovery(stubbed.replicas))
    env |= room_of(stubbed)
    env["LLM_RING__STORE__URL"] = f'"{store_url}"'
    env["LLM_RING__STORE__PASSWORD_FILE"] = f'"{store_password}"'
    running = start_service(workdir / "service-store", env)
    running.listen = env["LLM_RING__SERVICE__METRICS_LISTEN"].strip('"')  # its /metrics, read at the end
    return running


def counting_env() -> dict[str, str]:
    """A service counting with SmolLM2's own tokenizer."""
    from extproc.stack.models import smollm2_gguf

    return {"LLM_RING__SERVICE__TOKENIZER": json.dumps(str(smollm2_gguf()))}


def store_health(service: Running) -> dict[str, Any]:
    """Whether the sharing service used its store throughout: its store metrics after the run."""
    text = httpx.get(f"http://{service.listen}/metrics", timeout=5.0).text
    values = {(sample.name, sample.labels.get("call", "")): sample.value
              for family in text_string_to_metric_families(text) for sample in family.samples}
    errors = sum(value for (name, _), value in values.items() if name == "llm_ring_store_errors_total")
    return {"errors": int(errors), "in_use_at_end": values.get(("llm_ring_store_in_use", ""), 0) == 1}


def measure(
    ports: list[int], processes: dict[str, Running], level: int, seconds: float, conversations: int
) -> dict[str, Any]:
    """One cell: load for ``seconds`` and the CPU time each process spent per request."""
    before = {name: cpu_seconds(running) for name, running in processes.items()}
    cell = asyncio.run(load(ports, level, seconds, conversations))
    for name, running in processes.items():
        # the warm-up's requests are not counted: charge its share of the CPU time
        spent = (cpu_seconds(running) - before[name]) * seconds / (seconds + WARMUP_SECONDS)
        cell[f"{name}_cpu_us_per_request"] = round(spent / max(cell["requests"], 1) * 1e6, 1)
    return cell


def median_cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (requests and errors: summed)."""
    cell: dict[str, Any] = {
        key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0] if key != "first_error"
    }
    cell["requests"] = sum(run["requests"] for run in runs)
    cell["errors"] = sum(run["errors"] for run in runs)
    cell["first_error"] = next((run["first_error"] for run in runs if run.get("first_error")), "")
    return cell


def args_envoy_concurrency(args: argparse.Namespace) -> int:
    return int(getattr(args, "envoy_concurrency", 2))


def summarize(cells: list[dict[str, Any]], seconds: float, rounds: int, workdir: str | None,
              load_at_start: float) -> dict[str, Any]:
    by = {(cell["mode"], cell["concurrency"]): cell for cell in cells}
    added = []
    for level in sorted({cell["concurrency"] for cell in cells}):
        direct, envoy, floor, full = (by[(mode, level)] for mode in MODES)
        row: dict[str, Any] = {
            "concurrency": level,
            "envoy_over_direct_p50_ms": round(envoy["p50_ms"] - direct["p50_ms"], 3),
            "stub_ext_proc_over_envoy_p50_ms": round(floor["p50_ms"] - envoy["p50_ms"], 3),
            "stub_ext_proc_rps": floor["rps"],
            "ext_proc_over_envoy_p50_ms": round(full["p50_ms"] - envoy["p50_ms"], 3),
            "ext_proc_over_envoy_p99_ms": round(full["p99_ms"] - envoy["p99_ms"], 3),
            "ext_proc_rps": full["rps"],
            "ext_proc_rps_over_floor": round(full["rps"] / floor["rps"], 3) if floor["rps"] else None,
        }
        shared = by.get((STORE_MODE, level))
        if shared is not None:  # --store on: what the store round trip adds to the same service
            row["store_over_envoy_p50_ms"] = round(shared["p50_ms"] - envoy["p50_ms"], 3)
            row.update(_variant_figures("store", shared, full, floor))
        counted = by.get((TOKENIZER_MODE, level))
        if counted is not None:  # --tokenizer on: the same service counting with the model's tokenizer
            row.update(_variant_figures("tokenizer", counted, full, floor))
        queued = by.get((FLOW_MODE, level))
        if queued is not None:  # --flow on: the same service with flow control, nothing waiting
            row.update(_variant_figures("flow", queued, full, floor))
        row.update({"own_" + key: value for key, value in floor_ratios(floor, full).items()})
        if (POOL_MODE, level) in by:  # --mode pool: the InferencePool data plane, against its own floor
            pool_floor, pool = by[(POOL_FLOOR, level)], by[(POOL_MODE, level)]
            row.update({"pool_" + key: value for key, value in floor_ratios(pool_floor, pool).items()})
            row["pool_rps"], row["pool_floor_rps"] = pool["rps"], pool_floor["rps"]
        added.append(row)
    low = added[0]
    best_rps = max(row["ext_proc_rps"] for row in added)
    return {
        "benchmark": "gateway",
        "seconds_per_cell": seconds,
        "rounds": rounds,
        "cells": cells,
        "added": added,
        "targets": {
            "added_p50_ms": TARGET_ADDED_P50_MS,
            "added_p99_ms": TARGET_ADDED_P99_MS,
            "ext_proc_rps": TARGET_RPS,
            # latency targets judged at the lowest concurrency (no queueing), throughput at the best
            "met": {
                "added_p50": low["ext_proc_over_envoy_p50_ms"] <= TARGET_ADDED_P50_MS,
                "added_p99": low["ext_proc_over_envoy_p99_ms"] <= TARGET_ADDED_P99_MS,
                "rps": best_rps >= TARGET_RPS,
            },
        },
        "workdir": workdir,
        # other work on these cores shows in every figure: say how busy the machine was
        "load_average_1m_at_start": round(load_at_start, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def floor_ratios(floor: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """The service's figures as ratios to the do-nothing floor of the same data plane and run."""
    def ratio(key: str) -> float | None:
        return round(measured[key] / floor[key], 3) if floor[key] else None

    return {"p50_over_floor": ratio("p50_ms"), "p99_over_floor": ratio("p99_ms"), "rps_over_floor": ratio("rps")}


def _variant_figures(name: str, variant: dict[str, Any], full: dict[str, Any],
                     floor: dict[str, Any]) -> dict[str, Any]:
    """A variant of the service (``--store on``, ``--tokenizer on``, ``--flow on``) against the same service
    without it."""
    return {f"{name}_over_ext_proc_p50_ms": round(variant["p50_ms"] - full["p50_ms"], 3),
            f"{name}_rps": variant["rps"],
            f"{name}_rps_over_floor": round(variant["rps"] / floor["rps"], 3) if floor["rps"] else None,
            f"{name}_rps_ratio": variant.get("rps_ratio"), f"{name}_cpu_ratio": variant.get("cpu_ratio")}


def _variant_lines(name: str, without: str, levels: list[int], added: dict[int, dict[str, Any]]) -> list[str]:
    return [f"{level:>4} | p50 {row[f'{name}_over_ext_proc_p50_ms']:+.3f} ms over ext_proc without it; "
            f"{row[f'{name}_rps']:.0f} req/s = {row[f'{name}_rps_over_floor']:.2f} x the floor "
            f"({without} {row['ext_proc_rps_over_floor']:.2f} x); round by round, over ext_proc without it: "
            f"req/s {row[f'{name}_rps_ratio']:.3f} x, ext_proc CPU per request {row[f'{name}_cpu_ratio']:.3f} x"
            for level in levels for row in (added[level],)]


def _variant_sections(result: dict[str, Any], by: dict[tuple[str, int], dict[str, Any]], levels: list[int],
                      added: dict[int, dict[str, Any]]) -> list[str]:
    """The lines of --store on, --tokenizer on and --flow on, each against the service without it."""
    lines: list[str] = []
    if "store" in result:
        store = result["store"]
        lines.append(f"the shared store ({STORE_MODE}: one redis round trip before each decision): "
                     f"{store['errors']} store errors, in use at the end: {'yes' if store['in_use_at_end'] else 'NO'}")
        lines += _variant_lines("store", "without the store", levels, added)
    if (TOKENIZER_MODE, levels[0]) in by:
        lines.append(f"tokenization on ({TOKENIZER_MODE}: the model's tokenizer and chat template) vs off "
                     "(characters / 4), against the do-nothing floor:")
        lines += _variant_lines("tokenizer", "off", levels, added)
    if (FLOW_MODE, levels[0]) in by:
        lines.append(f"flow control on ({FLOW_MODE}: nothing waits, every request routed at once) vs off, "
                     "against the do-nothing floor:")
        lines += _variant_lines("flow", "off", levels, added)
        lines.append(f"flow control: {result['flow']['at_once']} requests routed at once, {result['flow']['other']} "
                     "otherwise")
    return lines


def render_table(result: dict[str, Any]) -> str:
    levels = sorted({cell["concurrency"] for cell in result["cells"]})
    by = {(cell["mode"], cell["concurrency"]): cell for cell in result["cells"]}
    modes = [mode for mode in (*MODES, STORE_MODE, TOKENIZER_MODE, FLOW_MODE, *POOL_MODES) if (mode, levels[0]) in by]
    lines = [
        f"{'conc':>4} | " + " | ".join(f"{mode:^26}" for mode in modes) + " | ext_proc adds (p50 / p99)",
        f"{'':>4} | " + " | ".join(f"{'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}" for _ in modes) + " |",
    ]
    added = {row["concurrency"]: row for row in result["added"]}
    for level in levels:
        cells = " | ".join(
            f"{by[(m, level)]['p50_ms']:8.3f} {by[(m, level)]['p99_ms']:8.3f} {by[(m, level)]['rps']:8.0f}"
            for m in modes
        )
        row = added[level]
        added_p50, added_p99 = row["ext_proc_over_envoy_p50_ms"], row["ext_proc_over_envoy_p99_ms"]
        lines.append(f"{level:>4} | {cells} | {added_p50:+.3f} / {added_p99:+.3f} ms")
    targets = result["targets"]
    met = targets["met"]
    lines.append(
        f"targets: added p50 <= {targets['added_p50_ms']} ms ({'met' if met['added_p50'] else 'MISSED'}), "
        f"added p99 <= {targets['added_p99_ms']} ms ({'met' if met['added_p99'] else 'MISSED'}) at c={levels[0]}; "
        f">= {targets['ext_proc_rps']:.0f} req/s through ext_proc ({'met' if met['rps'] else 'MISSED'})"
    )
    lines += _variant_sections(result, by, levels, added)
    if (POOL_MODE, levels[0]) in by:
        lines.append("ratios to the floor of the same data plane and run (ext_proc / do-nothing stub; "
                     "p50, p99, req/s): own Envoy config | InferencePool data plane (AI Gateway, full duplex, TLS)")
        for level in levels:
            row = added[level]
            own, pool = (" ".join(f"{row[f'{side}_{key}_over_floor']:.2f}x" for key in ("p50", "p99", "rps"))
                         for side in ("own", "pool"))
            lines.append(f"{level:>4} | {own} | {pool}")
    lines.append("CPU per request, us (envoy / ext_proc process):")
    for level in levels:
        parts = []
        for mode in modes[1:]:
            cell = by[(mode, level)]
            ext_proc = cell.get("ext_proc_cpu_us_per_request")
            parts.append(f"{mode} {cell['envoy_cpu_us_per_request']:.0f}" + (f" / {ext_proc:.0f}" if ext_proc else ""))
        lines.append(f"{level:>4} | " + " | ".join(parts))
    lines.append(
        f"each figure: the median of {result['rounds']} rounds of {result['seconds_per_cell']:g} s, modes alternating; "
        f"machine: {result['cpus']} CPUs, 1-minute load average {result['load_average_1m_at_start']} at the start, "
        f"{result['load_average_1m']} at the end"
    )
    if result["load_average_1m_at_start"] > BUSY_LOAD_PER_CPU * result["cpus"]:
        lines.append(
            f"note: the machine was busy before the benchmark started (load average "
            f"{result['load_average_1m_at_start']} on {result['cpus']} CPUs): the ratios to the floor compare "
            f"only with runs on a quiet machine"
        )
    errors = sum(cell["errors"] for cell in result["cells"])
    if errors:
        first = next(cell["first_error"] for cell in result["cells"] if cell["first_error"])
        lines.append(f"errors: {errors} non-200 answers, the first: {first!r} (see --json cells)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the client


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
