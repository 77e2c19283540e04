"""`llm-ring sim`: run the real policies on simulated replicas, over many seeds and fleet sizes.

Writes the same experiment folders as `llm-ring run` (one per fleet size when several
are given), then prints per fleet size the per-policy summary as mean ± 95 % CI
across seeds (the shared analysis in extproc/analysis computes every number).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

from extproc.analysis.metrics import connect, paired_differences
from extproc.analysis.report import SUMMARY_FILE, build_report, pictures_hint, render_markdown, render_stats
from extproc.cli_input import UsageError, at_least, distinct, new_folder, parse_seeds
from extproc.sim.arena import arena, ceiling_line
from extproc.sim.costmodel import CostModel, CostModelError, load_cost_model
from extproc.sim.flow_runs import Variant, flow_runs, parse_variant, render_table, summarise
from extproc.sim.model_loads import loads_table, render_loads
from extproc.sim.mooncake import TraceError, cacheable_ceiling
from extproc.sim.roll import RollSettings, render_rolls, roll_runs
from extproc.sim.routers import ROUTER_STATES
from extproc.sim.runs import (
    SIM_CONFIG,
    SimConfig,
    SimRouterModeSection,
    Source,
    load_sim_config,
    parse_policy,
    profile_source,
    run_experiment,
    store_outage,
    trace_source,
)
from extproc.traffic import ProfileError


def configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="traffic profile name or JSON path (same conversations as Locust)")
    source.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--policies", nargs="+", required=True, metavar="POLICY",
                        help="policy names, optionally with knobs: bounded:load_unit=tokens,epsilon=0.5")
    parser.add_argument("--seeds", nargs="+", required=True, metavar="SEED",
                        help="seeds: integers or ranges like 1-20")
    parser.add_argument("--replicas", nargs="+", type=at_least(1), metavar="N",
                        help="fleet sizes to simulate (default 3; a mixed --cost-model: the sum of its counts)")
    parser.add_argument("--scale-at", type=float, metavar="S",
                        help="add one replica S simulated seconds after the start")
    parser.add_argument("--scale", nargs="+", default=[], metavar="T:N",
                        help="set the fleet to N replicas at T seconds (scale up or down)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=SIM_CONFIG, help=f"simulator settings (default {SIM_CONFIG})")
    _replica_options(parser)
    _gateway_options(parser)
    _scenario_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _replica_options(parser: argparse.ArgumentParser) -> None:
    """What the simulated replicas are ([replica], [host])."""
    parser.add_argument("--cost-model", nargs="+", metavar="NAME[:COUNT]",
                        help="cost model name or path (default: [replica] cost_model); a mixed fleet: "
                             "NAME:COUNT NAME:COUNT ..., replicas llm-0.. in that order")
    parser.add_argument("--slow", nargs="+", default=[], metavar="REPLICA:AT:FACTOR",
                        help="REPLICA runs FACTOR times slower from AT simulated seconds on")
    parser.add_argument("--slots", type=at_least(1), help="slots per replica (default: [replica] slots)")
    parser.add_argument("--cache-ram-mib", type=at_least(0, float), help="host-RAM prompt cache per replica")
    parser.add_argument("--host-cores", type=at_least(0, float),
                        help="replicas share this many cores, like the local stack (0 = a CPU each; default: [host])")
    parser.add_argument("--threads", type=at_least(1),
                        help="CPU threads of a busy replica (default: [replica] threads)")


def _gateway_options(parser: argparse.ArgumentParser) -> None:
    """The gateway routers in front of the fleet ([gateway])."""
    parser.add_argument("--routers", type=at_least(1),
                        help="gateway routers; each request meets one at random (default: [gateway] routers)")
    parser.add_argument("--router-state", choices=ROUTER_STATES,
                        help="separate views, one shared, or conversation affinity (default: [gateway] router_state)")
    parser.add_argument("--store-lag-ms", type=at_least(0, float),
                        help="--router-state store: a router's writes reach the others this late "
                             "(default: [gateway] store_lag_ms)")
    parser.add_argument("--store-handoff", action=argparse.BooleanOptionalAction, default=None,
                        help="--router-state store: a release by the next turn reaches every router at once "
                             "(default: [gateway] store_handoff)")
    parser.add_argument("--store-outage", metavar="AT:SECONDS",
                        help="--router-state store: the store is down from AT for SECONDS simulated seconds "
                             "(default: [gateway] store_outage_at_s, store_outage_s)")


def _scenario_options(parser: argparse.ArgumentParser) -> None:
    """Traces, rolling restarts, hot-spot relief, flow control, router mode."""
    parser.add_argument("--time-scale", type=float, help="traces: multiply arrival times (default: [trace])")
    parser.add_argument("--limit", type=at_least(1), help="traces: only the first N requests")
    parser.add_argument("--roll-at", type=float, metavar="S",
                        help="a rolling restart from S simulated seconds: each run without and with migration "
                             "(docs/migration.md); prints the roll window's cached share and p95 TTFT")
    parser.add_argument("--restart-s", type=at_least(0, float),
                        help="--roll-at: a replica is back this long after it was drained (default: [roll] restart_s)")
    parser.add_argument("--transfer-gb-per-s", type=float,
                        help="--roll-at: save + copy + restore throughput of a migration (default: [roll] "
                             "transfer_gb_per_s)")
    parser.add_argument("--relieve-hot-spots", action=argparse.BooleanOptionalAction, default=None,
                        help="a turn sent away from the replica holding its cache takes the cache along when that "
                             "is quicker than computing it (default: [migration] relieve_hot_spots)")
    parser.add_argument("--flow", nargs="+", metavar="VARIANT",
                        help="through flow control: none fifo round-robin las vtc ours, knobs as ours:patience=false "
                             "(extproc/sim/flow_runs.py); prints per-tenant p95 TTFT, Jain index, cached share, "
                             "throughput; a trace is split into [flow] trace_tenants")
    parser.add_argument("--models", metavar="NAME:SHARE,..",
                        help="llama.cpp router mode: every replica serves these models, each conversation names one "
                             "in proportion to its share (smollm2:0.5,tiny:0.5; default: [router_mode] models); "
                             "prints model loads, cached share and p95 TTFT per policy")
    parser.add_argument("--model", default="",
                        help="the model every request names, as a live run's clients named it (its experiment.json's "
                             "model): conversations are keyed under it as the service keys them, so a profile's "
                             "simulation places them on the ring where that run did (not with router mode)")
    parser.add_argument("--models-max", type=at_least(1),
                        help="router mode: models a replica keeps loaded at once (default: [router_mode] models_max)")


class Inputs(NamedTuple):
    """The command's inputs, read and checked."""

    source: Source
    seeds: list[int]
    config: SimConfig
    cost: CostModel  # the fleet's (a mixed fleet's first)
    models: list[CostModel]  # a mixed fleet: each replica's, in order ([]: one cost model)
    fleet_sizes: list[int]
    scale: list[tuple[float, int]]  # --scale events
    slow: tuple[tuple[str, float, float], ...]
    variants: list[Variant]  # --flow


def main(args: argparse.Namespace) -> int:
    try:
        inputs = read_inputs(args)
    except TraceError as exc:
        raise UsageError(f"--trace {exc}") from None
    except (CostModelError, ProfileError, ValueError) as exc:  # bad input: one line, exit 2
        raise UsageError(str(exc)) from None
    source, seeds, config, cost, fleet_sizes = inputs.source, inputs.seeds, inputs.config, inputs.cost, \
        inputs.fleet_sizes
    if args.roll_at is not None:
        return main_roll(args, source, seeds, config, cost, fleet_sizes)
    if inputs.variants:
        return main_flow(args, source, inputs.variants, seeds, config, cost, fleet_sizes)
    return main_runs(args, inputs)


def read_inputs(args: argparse.Namespace) -> Inputs:
    """Every input checked, in this order, before anything runs; the out dir made last."""
    config = with_options(load_sim_config(args.config), args)
    seeds = parse_seeds(args.seeds)
    distinct(args.replicas or [], "--replicas")
    distinct(args.policies, "--policies")
    if args.time_scale is not None and args.time_scale <= 0:
        raise UsageError(f"--time-scale: must be > 0 (got {args.time_scale:g})")
    for spec in args.policies:
        parse_policy(spec, config.routing)  # fail before any run
    models = parse_models(args.cost_model or [])
    cost = models[0] if models else load_cost_model(config.cost_model)
    if models:
        if args.replicas not in (None, [len(models)]):
            raise ValueError(f"--replicas: a mixed --cost-model has {len(models)} replicas "
                             f"(got {' '.join(map(str, args.replicas))})")
        config = replace(config, cost_model=args.cost_model[0].rpartition(":")[0])  # the first model
    fleet_sizes = [len(models)] if models else args.replicas or [3]
    slow = parse_slow(args.slow, max(fleet_sizes))
    if cost.server is not None and cost.server.kv_cache == "paged":
        for option, value in (("--slots", args.slots), ("--cache-ram-mib", args.cache_ram_mib)):
            if value is not None:
                raise ValueError(f"{option}: does not apply to the paged cost model {cost.name} "
                                 "(its server section sets the KV pool and max_running)")
    variants = [parse_variant(spec, config.flow) for spec in args.flow or [] if config.flow is not None]
    check_flow(args, config)
    tenants = tuple(config.flow.trace_tenants.items()) if args.flow and config.flow is not None else ()
    source = profile_source(args.profile) if args.profile else trace_source(
        args.trace, config.time_scale, config.jitter_bucket_s, args.limit, tenants)
    scale = parse_scale(args.scale)
    if args.scale_at is not None and args.scale_at <= 0:
        raise ValueError(f"--scale-at must be > 0 seconds (got {args.scale_at:g})")
    check_roll(args, models, config)
    check_router_mode(args, config, [cost, *models])
    new_folder(args.out_dir)  # last: every other input is known good
    return Inputs(source, seeds, config, cost, models, fleet_sizes, scale, slow, variants)


def with_options(config: SimConfig, args: argparse.Namespace) -> SimConfig:
    """sim.toml's settings with the command line's over them."""
    return replace(
        config,
        slots=args.slots or config.slots,
        cache_ram_mib=config.cache_ram_mib if args.cache_ram_mib is None else args.cache_ram_mib,
        cost_model=args.cost_model[0] if args.cost_model else config.cost_model,
        threads=args.threads or config.threads,
        host_cores=config.host_cores if args.host_cores is None else args.host_cores,
        time_scale=args.time_scale or config.time_scale,
        routers=args.routers or config.routers,
        router_state=args.router_state or config.router_state,
        store_lag_ms=config.store_lag_ms if args.store_lag_ms is None else args.store_lag_ms,
        store_handoff=config.store_handoff if args.store_handoff is None else args.store_handoff,
        store_outage=config.store_outage if args.store_outage is None else parse_outage(args.store_outage),
        roll_restart_s=config.roll_restart_s if args.restart_s is None else args.restart_s,
        migration_transfer_gb_per_s=args.transfer_gb_per_s or config.migration_transfer_gb_per_s,
        relieve_hot_spots=config.relieve_hot_spots if args.relieve_hot_spots is None else args.relieve_hot_spots,
        router_mode=router_mode(args, config),
    )


def main_runs(args: argparse.Namespace, inputs: Inputs) -> int:
    """Per fleet size, the experiment folder and its summary; with a trace, the arena; in router
    mode, the model loads."""
    source, seeds, config, cost = inputs.source, inputs.seeds, inputs.config, inputs.cost
    results: dict[str, Any] = {}
    differences: dict[str, Any] = {}  # replicas -> paired differences to the first policy
    arenas: dict[str, Any] = {}  # traces: replicas -> the arena table
    loads: dict[str, Any] = {}  # router mode: replicas -> model loads, cached share, p95 TTFT
    ceiling = cacheable_ceiling(source.trace) if source.trace is not None else None
    if source.trace is not None and not args.json:
        print(ceiling_line(ceiling))
    started = time.perf_counter()
    for replicas in inputs.fleet_sizes:
        events = inputs.scale + ([(args.scale_at, replicas + 1)] if args.scale_at is not None else [])
        fleet = config.fleet(replicas, cost, tuple(sorted(events)), models=tuple(inputs.models), slow=inputs.slow)
        out_dir = args.out_dir / f"replicas-{replicas}" if len(inputs.fleet_sizes) > 1 else args.out_dir
        run_experiment(source, args.policies, seeds, config, fleet, out_dir,
                       progress=lambda line: print(line, file=sys.stderr), model=args.model)
        report = build_report(out_dir)
        (out_dir / SUMMARY_FILE).write_text(render_markdown(report, with_runs=True))
        key = str(replicas)
        results[key] = report["summary"]
        differences[key] = paired_differences(report["runs"], args.policies)
        if not args.json:
            print_summary(args, inputs, replicas, out_dir, results[key], differences[key])
        if source.trace is not None:
            metrics, arenas[key] = arena(connect(out_dir), args.policies, ceiling)
            if not args.json:
                print(f"\narena, {source.label}: {replicas} replicas, cost model {cost.name}, {len(seeds)} seeds")
                print(render_stats(arenas[key], metrics))
        if fleet.router_mode is not None:
            loads[key] = loads_table(out_dir, args.policies)
            if not args.json:
                print(f"\nrouter mode, models {fleet.router_mode.shares}, models_max {fleet.router_mode.models_max}: "
                      f"{replicas} replicas, {len(seeds)} seeds")
                print(render_loads(loads[key]))
    relief = fleet.relief
    if relief is not None:
        print(f"hot-spot relief: {relief.moves:,} caches moved ({relief.moved_bytes / 1e9:,.1f} GB) over every run",
              file=sys.stderr)
    print(f"simulated in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.json:
        out: dict[str, Any] = {"source": source.label, "seeds": seeds, "replicas": results,
                               "paired": {"against": args.policies[0], "replicas": differences}}
        if source.trace is not None:
            out["arena"] = {"ceiling": ceiling, "cost_model": cost.name, "replicas": arenas}
        if loads:
            out["model_loads"] = loads
        print(json.dumps(out))
    return 0


def print_summary(args: argparse.Namespace, inputs: Inputs, replicas: int, out_dir: Path, summary: Any,
                  paired: Any) -> None:
    """One fleet size's summary table, and its differences to the first policy paired by seed."""
    config = inputs.config
    outage = config.store_outage
    store = (f" (lag {config.store_lag_ms:g} ms{', handoff' if config.store_handoff else ''}"
             f"{f', down {outage[0]:g}-{outage[1]:g} s' if outage else ''})"
             if config.router_state == "store" else "")
    print(f"\n{inputs.source.label}: {replicas} replicas, {len(inputs.seeds)} seeds, "
          f"{config.routers} router(s) {config.router_state}{store} ({out_dir})")
    print(render_stats(summary))
    if paired:
        print(f"\npaired by seed, difference to {args.policies[0]}:")
        print(render_stats(paired))
    print(pictures_hint(out_dir), file=sys.stderr)


def router_mode(args: argparse.Namespace, config: SimConfig) -> SimRouterModeSection | None:
    """[router_mode] with --models and --models-max over it."""
    section = config.router_mode
    if section is None:
        return None
    update: dict[str, Any] = {} if args.models_max is None else {"models_max": args.models_max}
    if args.models is not None:
        update["models"] = parse_shares(args.models)
    return section.model_copy(update=update).checked()


def parse_shares(text: str) -> dict[str, float]:
    """``NAME:SHARE,NAME:SHARE ..`` (shares > 0; they need not sum to 1)."""
    shares: dict[str, float] = {}
    for item in text.split(","):
        name, _, share = item.partition(":")
        try:
            shares[name] = float(share)
        except ValueError:
            raise ValueError(f"--models: {item!r} is not NAME:SHARE (smollm2:0.5,tiny:0.5)") from None
        if not name or shares[name] <= 0:
            raise ValueError(f"--models: {item!r}: a model name and a share > 0")
    return shares


def check_router_mode(args: argparse.Namespace, config: SimConfig, costs: list[CostModel]) -> None:
    if args.model and config.models() is not None:
        raise ValueError("--model: router mode names each conversation's model (--models); one or the other")
    if config.models() is None:
        if args.models_max is not None:
            raise ValueError("--models-max: only with models in router mode (--models or [router_mode] models)")
        return
    if args.flow or args.roll_at is not None:
        raise ValueError("--models: router mode runs without --flow and --roll-at")
    if any(cost.server is not None and cost.server.kv_cache == "paged" for cost in costs):
        raise ValueError("--models: router mode is llama.cpp's: a slot server's cost model, not a paged one")


def check_flow(args: argparse.Namespace, config: SimConfig) -> None:
    if not args.flow:
        return
    distinct(args.flow, "--flow")
    if config.routers != 1 or args.roll_at is not None or args.scale or args.scale_at is not None:
        raise ValueError("--flow: one gateway router (the queue is its), without --roll-at, --scale or --scale-at")


def main_flow(args: argparse.Namespace, source: Any, variants: list[Variant], seeds: list[int], config: SimConfig,
              cost: CostModel, fleet_sizes: list[int]) -> int:
    """--flow: per fleet size, the per-tenant table; flow.json in the out dir holds every run's figures."""
    args.out_dir.mkdir(parents=True)
    found: dict[str, Any] = {}
    started = time.perf_counter()
    for replicas in fleet_sizes:
        fleet = config.fleet(replicas, cost)
        runs = flow_runs(source, args.policies, variants, seeds, config, cost, fleet,
                         lambda line: print(line, file=sys.stderr))
        rows = summarise(runs)
        found[str(replicas)] = {"runs": runs, "summary": rows}
        if not args.json:
            print(f"\n{source.label}: {replicas} replicas, cost model {cost.name}, {len(seeds)} seeds, "
                  f"{' '.join(args.policies)}")
            print(render_table(rows))
    (args.out_dir / "flow.json").write_text(json.dumps({"source": source.label, "cost_model": cost.name,
                                                        "seeds": seeds, "replicas": found}, indent=1) + "\n")
    print(f"simulated in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"source": source.label, "seeds": seeds,
                          "replicas": {key: value["summary"] for key, value in found.items()}}))
    return 0


def check_roll(args: argparse.Namespace, models: list[CostModel], config: SimConfig) -> None:
    if config.migration_transfer_gb_per_s <= 0:
        raise ValueError(f"--transfer-gb-per-s must be > 0 (got {config.migration_transfer_gb_per_s:g})")
    if args.roll_at is None:
        if args.restart_s is not None:
            raise ValueError("--restart-s: only with --roll-at")
        if args.transfer_gb_per_s is not None and not config.relieve_hot_spots:
            raise ValueError("--transfer-gb-per-s: only with --roll-at or --relieve-hot-spots")
        return
    if args.roll_at <= 0:
        raise ValueError(f"--roll-at must be > 0 seconds (got {args.roll_at:g})")
    if models or args.scale or args.scale_at is not None or args.slow or config.relieve_hot_spots:
        raise ValueError("--roll-at: one cost model for the fleet, without --scale, --scale-at, --slow or "
                         "--relieve-hot-spots")


def main_roll(args: argparse.Namespace, source: Any, seeds: list[int], config: SimConfig, cost: CostModel,
              fleet_sizes: list[int]) -> int:
    """--roll-at: per fleet size, policy and seed, the roll without and with migration; roll.json
    in the out dir holds every run's figures."""
    settings = RollSettings(args.roll_at, config.roll_restart_s, True, config.migration_transfer_gb_per_s * 1e9,
                            config.migration_min_tokens)
    args.out_dir.mkdir(parents=True)
    found: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for replicas in fleet_sizes:
        runs = found[str(replicas)] = roll_runs(source, args.policies, seeds, config, cost, replicas, settings,
                                                lambda line: print(line, file=sys.stderr))
        if not args.json:
            print(f"\n{source.label}: {replicas} replicas, cost model {cost.name}, rolled from {args.roll_at:g} s, "
                  f"{config.roll_restart_s:g} s a restart, {config.migration_transfer_gb_per_s:g} GB/s transfers")
            print(render_rolls(runs))
    drill = {key: value for key, value in asdict(settings).items() if key != "migrate"}  # each run says its own
    (args.out_dir / "roll.json").write_text(json.dumps({"source": source.label, "roll": drill, "replicas": found},
                                                       indent=1) + "\n")
    print(f"simulated in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"source": source.label, "seeds": seeds, "roll": found}))
    return 0


def parse_models(items: list[str]) -> list[CostModel]:
    """``NAME`` (one model for the fleet: []) or ``NAME:COUNT ...``: each replica's cost model, in order."""
    if len(items) == 1 and not items[0].rpartition(":")[2].isdigit():
        return []
    models: list[CostModel] = []
    for item in items:
        name, _, count = item.rpartition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--cost-model: {item!r} is not NAME:COUNT (a mixed fleet gives each model a count >= 1)")
        models += [load_cost_model(name)] * int(count)
    return models


def parse_slow(items: list[str], replicas: int) -> tuple[tuple[str, float, float], ...]:
    """``REPLICA:AT:FACTOR`` items: (replica, at seconds, factor > 0), the replica one of llm-0..llm-(N-1)."""
    events = []
    for item in items:
        parts = item.split(":")
        try:
            name, at, factor = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"--slow: {item!r} is not REPLICA:AT:FACTOR (llm-1:60:3)") from None
        known = [f"llm-{index}" for index in range(replicas)]
        if len(parts) != 3 or name not in known or at < 0 or factor <= 0:
            raise ValueError(f"--slow: {item!r}: REPLICA one of llm-0..llm-{replicas - 1}, AT >= 0 s, FACTOR > 0")
        events.append((name, at, factor))
    return tuple(events)


def parse_scale(items: list[str]) -> list[tuple[float, int]]:
    events = []
    for item in items:
        at, sep, count = item.partition(":")
        try:
            events.append((float(at), int(count)))
        except ValueError:
            raise ValueError(f"--scale: {item!r} is not T:N (seconds:replicas)") from None
        if not sep:
            raise ValueError(f"--scale: {item!r} is not T:N (seconds:replicas)")
        if events[-1][1] < 1 or events[-1][0] < 0:
            raise ValueError(f"--scale: {item!r}: a fleet needs at least 1 replica, from 0 seconds on")
    return events


def parse_outage(text: str) -> tuple[float, float] | None:
    """``AT:SECONDS``, both numbers >= 0 (SECONDS 0: no outage)."""
    at, _, seconds = text.partition(":")
    try:
        return store_outage(float(at), float(seconds))
    except ValueError:
        raise ValueError(f"--store-outage {text!r}: expected AT:SECONDS, two numbers >= 0") from None
