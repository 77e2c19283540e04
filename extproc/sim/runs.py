"""Simulated runs: settings, policy specs, one run, one experiment folder (the same layout as live runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from extproc.files import write_atomically
from extproc.policy_spec import ExperimentError
from extproc.policy_spec import parse_policy as experiment_policy
from extproc.records import REQUESTS_FILE, SPEEDS_FILE, RunMeta, write_records, write_run_metadata
from extproc.routing import POLICIES, make_policy
from extproc.routing.settings import MOVED_KEYS, SHARED_ROUTING_KEYS, RoutingSettings, with_knobs
from extproc.routing.speeds import Speed
from extproc.settings import SettingsError, parse_routing, read_toml, validate_settings
from extproc.sim.costmodel import CostModel, load_cost_model
from extproc.sim.engine import ClosedLoop, Fleet, Mixed, OpenLoop, Outcome, simulate
from extproc.sim.flow import FlowSpec
from extproc.sim.mooncake import TraceError, TraceRequest, jittered_arrivals, read_trace
from extproc.sim.records import SIM_EPOCH_S, request_rows
from extproc.sim.relief import Relief
from extproc.sim.router_mode import RouterMode
from extproc.sim.routers import RouterTier, check_router_tier
from extproc.sim.workload import MIXES, mixed_workload, profile_workload, requests_from_trace, with_models
from extproc.strict import Strict
from extproc.traffic import Profile, load_profile

SIM_CONFIG = Path(__file__).parent / "sim.toml"
# per answer, the speed the router learnt of its replica and the replica's true speed (notebooks chart them)


@dataclass(frozen=True)
class SimConfig:
    routing: dict[str, Any]  # base knobs (no policy)
    slots: int
    cache_ram_mib: float
    cost_model: str
    threads: int
    host_cores: float
    time_scale: float
    release_lag_ms: float
    routers: int  # gateway routers in front of the fleet (extproc/sim/routers.py)
    router_state: str  # separate | shared | affinity | ... | store (extproc/sim/routers.py)
    store_lag_ms: float  # router_state store: a write reaches the other routers this much later
    store_handoff: bool  # router_state store: a release by the next turn reaches every router at once
    store_outage: tuple[float, float] | None  # router_state store: (from, until) s, the store is down
    roll_restart_s: float  # --roll-at: a replica is back this long after it was drained
    migration_transfer_gb_per_s: float  # --roll-at with migration: save + copy + restore of a conversation's KV
    migration_min_tokens: int  # --roll-at with migration: shorter caches are not moved
    relieve_hot_spots: bool  # a conversation sent away from its cache takes it along (extproc/sim/relief.py)
    # traces: arrivals sharing a bucket this wide are spread over it with the seed (None: not read)
    jitter_bucket_s: float | None = None
    flow: SimFlowSection | None = None  # [flow]: flow control's settings in `llm-ring sim --flow` (None: not read)
    router_mode: SimRouterModeSection | None = None  # [router_mode]: several models per replica (None: not read)

    def fleet(self, replicas: int, cost: CostModel, scale: tuple[tuple[float, int], ...] = (),
              host_cores: float | None = None, cache: bool = True, models: tuple[CostModel, ...] = (),
              slow: tuple[tuple[str, float, float], ...] = ()) -> Fleet:
        """The simulated fleet these settings describe (``host_cores`` overrides [host] cores;
        ``cache=False``: no host-RAM cache, for paged cost models that bring their own pool;
        ``models``: a mixed fleet, replica i's cost model; ``slow``: (replica, at s, factor) slowdowns)."""
        relief = Relief(self.migration_transfer_gb_per_s * 1e9, self.migration_min_tokens) \
            if self.relieve_hot_spots else None
        return Fleet(replicas, self.slots, cache_tokens(self.cache_ram_mib, cost) if cache else 0, scale,
                     self.host_cores if host_cores is None else host_cores, self.threads,
                     self.release_lag_ms / 1000,
                     tuple((model, cache_tokens(self.cache_ram_mib, model) if cache else 0) for model in models),
                     slow, relief, self.models())

    def models(self) -> RouterMode | None:
        """[router_mode] as the fleet's (None: no models named, one model per replica)."""
        section = self.router_mode
        if section is None or not section.models:
            return None
        return RouterMode(section.models, section.load_s, section.models_max, section.report_lag_ms / 1000)


class SimReplicaSection(Strict):
    slots: int
    cache_ram_mib: float
    cost_model: str
    threads: int


class SimHostSection(Strict):
    cores: float


class SimTraceSection(Strict):
    time_scale: float
    jitter_bucket_ms: float


class SimGatewaySection(Strict):
    release_lag_ms: float
    routers: int
    router_state: str
    store_lag_ms: float
    store_handoff: bool
    store_outage_at_s: float  # the two make SimConfig.store_outage
    store_outage_s: float


class SimMigrationSection(Strict):
    roll_restart_s: float
    transfer_gb_per_s: float
    min_tokens: int
    relieve_hot_spots: bool


class SimRouterModeSection(Strict):
    """[router_mode]: the models each replica serves in llama.cpp's router mode (extproc/sim/router_mode.py)."""

    models: dict[str, float]  # model -> share of the conversations ({}: no router mode)
    models_max: int
    load_s: dict[str, float]  # model -> seconds its load takes
    report_lag_ms: float

    def checked(self) -> SimRouterModeSection:
        unknown = [model for model in self.models if model not in self.load_s]
        if unknown:
            raise ValueError(f"router_mode.models: no load_s for {', '.join(unknown)} "
                             f"(known: {', '.join(self.load_s)})")
        if any(share <= 0 for share in self.models.values()) or self.models_max < 1 or self.report_lag_ms < 0:
            raise ValueError("router_mode: every share must be > 0, models_max >= 1, report_lag_ms >= 0")
        if any(seconds < 0 for seconds in self.load_s.values()):
            raise ValueError("router_mode.load_s: a load takes >= 0 seconds")
        return self


class SimFlowSection(Strict):
    """[flow]: the queue's settings for `llm-ring sim --flow` (extproc/sim/flow_runs.py)."""

    objectives: dict[str, int]
    default_priority: int
    ttl_seconds: float
    band_size: int
    locality_deficit: float
    input_weight: float
    output_weight: float
    reserved_slots: int  # this router's (`ours`); the baselines run with none
    patience: bool  # this router's (`ours`); the baselines run without
    trace_tenants: dict[str, int]  # a trace's conversations split by hash into these tenants, by weight


class SimSettings(Strict):
    """sim.toml: every key, checked as every settings file is (extproc.settings.validate_settings)."""

    routing: dict[str, Any]  # the shared keys and a section per policy: checked by _check_routing, parse_policy
    replica: SimReplicaSection
    host: SimHostSection
    trace: SimTraceSection
    gateway: SimGatewaySection
    migration: SimMigrationSection
    router_mode: SimRouterModeSection
    flow: SimFlowSection


def load_sim_config(path: str | Path = SIM_CONFIG) -> SimConfig:
    raw = read_toml(path)
    checked = validate_settings(SimSettings, raw, str(path))
    _check_routing(checked.routing, path)
    replica, gateway = checked.replica, checked.gateway
    try:
        config = SimConfig(
            routing=dict(raw["routing"]), slots=replica.slots, cache_ram_mib=replica.cache_ram_mib,
            cost_model=replica.cost_model, threads=replica.threads, host_cores=checked.host.cores,
            time_scale=checked.trace.time_scale, release_lag_ms=gateway.release_lag_ms,
            routers=gateway.routers,
            router_state=gateway.router_state, store_lag_ms=gateway.store_lag_ms, store_handoff=gateway.store_handoff,
            store_outage=store_outage(gateway.store_outage_at_s, gateway.store_outage_s),
            jitter_bucket_s=checked.trace.jitter_bucket_ms / 1000.0,
            roll_restart_s=checked.migration.roll_restart_s,
            migration_transfer_gb_per_s=checked.migration.transfer_gb_per_s,
            migration_min_tokens=checked.migration.min_tokens, relieve_hot_spots=checked.migration.relieve_hot_spots,
            flow=checked.flow, router_mode=checked.router_mode.checked(),
        )
        check_router_tier(config.routers, config.router_state, config.store_lag_ms)
    except ValueError as exc:
        raise SettingsError(f"{path}: {exc}") from None
    return config


def _check_routing(routing: dict[str, Any], path: str | Path) -> None:
    """[routing]: every shared key but the policy (each run names its own), and sections of registered policies."""
    shared = [key for key in SHARED_ROUTING_KEYS if key != "policy"]
    valid = (*shared, *POLICIES)
    for key in routing:
        if f"routing.{key}" in MOVED_KEYS:
            raise SettingsError(f"{path}: routing.{key}: moved to {MOVED_KEYS[f'routing.{key}']}")
        if key not in valid:
            raise SettingsError(f"{path}: routing.{key}: unknown setting (valid: {', '.join(valid)})")
    for key in shared:
        if key not in routing:
            raise SettingsError(f"{path}: routing.{key}: missing (every setting must be given; there are no defaults)")


def store_outage(at_s: float, seconds: float) -> tuple[float, float] | None:
    """The store down from ``at_s`` for ``seconds`` (0: never down)."""
    if at_s < 0 or seconds < 0:
        raise ValueError(f"store outage: start and length must be >= 0 (got {at_s:g} s, {seconds:g} s)")
    return (at_s, at_s + seconds) if seconds else None


def parse_policy(spec: str, base: dict[str, Any]) -> RoutingSettings:
    """``name`` or ``name:key=value,...`` (the live runner's syntax) over the base knobs."""
    try:
        knobs = experiment_policy(spec).routing
    except ExperimentError as exc:
        raise SettingsError(str(exc)) from None
    return parse_routing(with_knobs(base, knobs), source=f"policy {spec!r}")


def cache_tokens(cache_ram_mib: float, cost: CostModel) -> int:
    """--cache-ram in MiB as a token capacity (KV bytes per token from the cost model)."""
    return int(cache_ram_mib * 2**20 // cost.kv_bytes_per_token)


@dataclass(frozen=True)
class Source:
    """Where requests come from: a traffic profile (closed loop) or a trace (open loop)."""

    label: str
    make: Callable[[int, int], ClosedLoop | OpenLoop | Mixed]  # (seed, prefix_block_chars) -> a fresh workload
    seeds_hash: bool  # traces: the seed varies the ring's hash_seed and the arrival jitter
    profile: Profile | None = None
    trace: list[TraceRequest] | None = None


def profile_source(name_or_path: str) -> Source:
    """A profile, or a mix of tenants' profiles (workload.MIXES: ``noisy-neighbour``)."""
    mix = MIXES.get(str(name_or_path))
    if mix is not None:
        for load in mix:
            load_profile(load.profile)  # fail before any run
        return Source(str(name_or_path), lambda seed, blocks: mixed_workload(mix, seed, blocks), False)
    profile = load_profile(name_or_path)
    return Source(profile.name, lambda seed, blocks: profile_workload(profile, seed, blocks), False, profile)


def trace_source(path: str | Path, time_scale: float, jitter_bucket_s: float | None,
                 limit: int | None = None, tenants: tuple[tuple[str, int], ...] = ()) -> Source:
    """``tenants``: the trace's conversations split into these (name, weight) by hash."""
    if jitter_bucket_s is None or jitter_bucket_s <= 0:
        raise SettingsError(f"[trace] jitter_bucket_ms: must be > 0 (got {jitter_bucket_s!r} s)")
    bucket_s = jitter_bucket_s
    trace: list[TraceRequest] = read_trace(path, limit)
    if not trace:
        raise TraceError(f"{path}: no requests")

    def make(seed: int, _: int) -> OpenLoop:  # a trace's requests carry its hash ids always
        return requests_from_trace(trace, time_scale, jittered_arrivals(trace, bucket_s, seed), tenants)

    return Source(Path(path).stem, make, True, trace=trace)


def run_once(workload: ClosedLoop | OpenLoop | Mixed, settings: RoutingSettings, cost: CostModel, fleet: Fleet,
             routers: int = 1, router_state: str = "separate", seed: int = 0, store_lag_ms: float = 0.0,
             store_handoff: bool = False, store_outage: tuple[float, float] | None = None,
             flow: FlowSpec | None = None) -> Outcome:
    """One run through ``routers`` gateway routers (``seed`` spreads the requests over them);
    ``flow``: through flow control."""
    tier = RouterTier(settings, routers, router_state, seed, store_lag_ms / 1000, store_handoff, store_outage)
    outcome = simulate(workload, tier, cost, fleet, flow=flow)
    for router in tier.distinct():
        if router.in_flight() or router.ledger.total("requests") or router.ledger.total("tokens"):
            raise RuntimeError(f"simulation left load in the ledger: {router.in_flight()} requests in flight")
    return outcome


def run_experiment(
    source: Source, policies: Iterable[str], seeds: Iterable[int], config: SimConfig, fleet: Fleet,
    out_dir: Path, progress: Callable[[str], None] = lambda _: None, model: str = "",
) -> int:
    """Every policy x seed into ``out_dir/<run_id>/`` (requests.parquet + run.json). Returns rows.
    ``model``: the model every request names, as a live run's client names it (without router
    mode): its conversations are then keyed as the service keys them (under the model), so a
    simulated run places them on the ring where the live one did."""
    cost = load_cost_model(config.cost_model)
    total = 0
    for seed in seeds:
        for spec in policies:
            base = {**config.routing, "hash_seed": seed} if source.seeds_hash else config.routing
            settings = parse_policy(spec, base)
            workload = source.make(seed, make_policy(settings, settings.replicas).prefix_block_chars)
            if fleet.router_mode is not None:
                with_models(workload, fleet.router_mode.shares, seed)
            elif model:
                with_models(workload, {model: 1.0}, seed)
            outcome = run_once(workload, settings, cost, fleet,
                               config.routers, config.router_state, seed, config.store_lag_ms,
                               config.store_handoff, config.store_outage)
            run_id = f"sim-{source.label}-r{fleet.replicas}-{spec.replace(':', '_').replace(',', '_')}-s{seed}"
            rows = request_rows(outcome.requests, run_id, spec, seed)
            write_records(rows, out_dir / run_id / REQUESTS_FILE)
            if outcome.speeds:
                write_speeds(outcome.speeds, out_dir / run_id / SPEEDS_FILE)
            write_run_metadata(_meta(run_id, spec, seed, source, settings, config, cost, fleet, outcome, len(rows)),
                               out_dir / run_id)
            total += len(rows)
            progress(f"{run_id}: {len(rows)} requests, {outcome.end_s:.0f} simulated s")
    return total


def _meta(run_id: str, spec: str, seed: int, source: Source, settings: RoutingSettings, config: SimConfig,
          cost: CostModel, fleet: Fleet, outcome: Outcome, rows: int) -> RunMeta:
    def iso(at_s: float) -> str:
        return datetime.fromtimestamp(SIM_EPOCH_S + at_s, UTC).isoformat()

    scale_up = next(((at, n) for at, n in fleet.scale if n > fleet.replicas), None)
    profile = dict(vars(source.profile)) if source.profile else {"trace": source.label}
    return RunMeta(
        run_id=run_id, policy=spec, seed=seed, simulated=True, profile=profile,
        routing=settings.knobs(), replicas_start=fleet.replicas, started_at=iso(0.0),
        finished_at=iso(outcome.end_s), scale_at_s=scale_up[0] if scale_up else None,
        scaled_to=scale_up[1] if scale_up else None, scale_ready_at=iso(scale_up[0]) if scale_up else None,
        status="finished", rows=rows,
        extra={"cost_model": config.cost_model, **({"server": asdict(cost.server)} if cost.server else {}),
               "slots": fleet.slots, "cache_tokens": fleet.cache_tokens,
               "host_cores": fleet.host_cores, "replica_threads": fleet.replica_threads,
               "routers": config.routers, "router_state": config.router_state,
               **({"store_lag_ms": config.store_lag_ms, "store_handoff": config.store_handoff,
                   "store_outage": list(config.store_outage) if config.store_outage else None}
                  if config.router_state == "store" else {}),
               "scale": [list(event) for event in fleet.scale], "events": outcome.events,
               **({"models": [model.name for model, _ in fleet.models]} if fleet.models else {}),
               **({"slow": [list(event) for event in fleet.slow]} if fleet.slow else {}),
               **(router_mode_meta(fleet.router_mode, outcome.loads) if fleet.router_mode else {})},
    )


def router_mode_meta(spec: RouterMode, loads: dict[str, int]) -> dict[str, Any]:
    """run.json's record of router mode: the models, and the loads counted (in all, per replica)."""
    return {"router_mode": {"models": dict(spec.shares), "models_max": spec.models_max, "load_s": dict(spec.load_s),
                            "report_lag_ms": spec.report_lag_s * 1000},
            "model_loads": sum(loads.values()), "model_loads_by_replica": loads}


def write_speeds(samples: list[tuple[float, str, str, Speed, Speed]], path: Path) -> None:
    """One row per answer: when, which replica (its cost model), the learnt and the true speed."""
    columns: dict[str, list[Any]] = {name: [] for name in (
        "at_s", "replica", "cost_model", "learnt_prefill_tokens_per_s", "true_prefill_tokens_per_s",
        "learnt_decode_tokens_per_s", "true_decode_tokens_per_s", "learnt_overhead_ms", "true_overhead_ms")}
    for at, replica, model, learnt, true in samples:
        for name, value in zip(columns, (at, replica, model, 1 / learnt.prefill_s_per_token,
                                         1 / true.prefill_s_per_token, 1 / learnt.decode_s_per_token,
                                         1 / true.decode_s_per_token, learnt.overhead_s * 1000,
                                         true.overhead_s * 1000), strict=True):
            columns[name].append(value)
    parquet = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), parquet)
    write_atomically(path, parquet.getvalue().to_pybytes())
