"""`llm-ring sim --flow VARIANT ..`: the same traffic through flow control's variants, per tenant.

A variant is a queue order with its switches, ``NAME[:knob=value,...]``:

- ``none``: no queue (every request goes to a replica at once; llama.cpp queues it);
- ``fifo``, ``round-robin``, ``las``, ``vtc``: the field's orders (extproc/routing/orders/),
  run without reserved slots and without patience;
- ``ours``: VTC with the locality deficit, [flow] reserved_slots and patience (sim.toml).

Knobs (ablations): ``reserved_slots=N``, ``patience=true|false``, ``locality_deficit=TOKENS``,
``patience_scale=X`` (a request waits X times its recompute for its full holder, at most half
the TTL) and ``turn_waits=true|false`` (its flow's turn past the deficit waits for the holder
too instead of sending it elsewhere: not work-conserving).
Each run's figures, per tenant: p95 time to first token of the answered requests, requests
answered and refused (429, 503); for the run: Jain's index (the service's definition,
extproc/routing/fairness.py, sampled every 5 simulated s), cached share of prompt tokens and
generated tokens per simulated second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from extproc.analysis.metrics import spread
from extproc.routing import make_policy
from extproc.routing.fairness import FairnessWindow
from extproc.routing.flows import FlowSettings
from extproc.routing.settings import with_knobs
from extproc.sim.costmodel import CostModel
from extproc.sim.engine import Fleet, Outcome
from extproc.sim.flow import FlowSpec
from extproc.sim.request import Request
from extproc.sim.runs import SimConfig, SimFlowSection, Source, parse_policy, run_once

ORDER_OF = {"none": None, "fifo": "fifo", "round-robin": "round-robin", "las": "las", "vtc": "vtc",
            "ours": "vtc-local"}
KNOBS = ("reserved_slots", "patience", "locality_deficit", "patience_scale", "turn_waits")
JAIN_WINDOW_S = 60.0  # the service's gauge's window (llm_ring_flow_jain_index)
JAIN_EVERY_S = 5.0


class Variant(NamedTuple):
    label: str
    order: str | None  # None: no queue
    reserved_slots: int
    patience: bool
    locality_deficit: float
    patience_scale: float = 1.0
    turn_waits: bool = False


def parse_variant(spec: str, section: SimFlowSection) -> Variant:
    """``NAME[:knob=value,...]`` (module docstring); ValueError names what is wrong."""
    name, _, knobs = spec.partition(":")
    if name not in ORDER_OF:
        raise ValueError(f"--flow: unknown variant {name!r} (known: {', '.join(ORDER_OF)})")
    ours = name == "ours"
    values: dict[str, Any] = {"reserved_slots": section.reserved_slots if ours else 0,
                              "patience": section.patience if ours else False,
                              "locality_deficit": section.locality_deficit, "patience_scale": 1.0,
                              "turn_waits": False}
    for knob in filter(None, knobs.split(",")):
        key, _, value = knob.partition("=")
        if key not in KNOBS or not value or name == "none":
            raise ValueError(f"--flow {spec!r}: {knob!r} is no knob of it (knobs: {', '.join(KNOBS)}; none for none)")
        values[key] = value.lower() == "true" if isinstance(values[key], bool) else type(values[key])(value)
    return Variant(spec, ORDER_OF[name], int(values["reserved_slots"]), bool(values["patience"]),
                   float(values["locality_deficit"]), float(values["patience_scale"]), bool(values["turn_waits"]))


def flow_spec(variant: Variant, section: SimFlowSection) -> FlowSpec | None:
    """The variant as flow control's settings (None: no queue)."""
    if variant.order is None:
        return None
    settings = FlowSettings(
        enabled=True, tenant_header="x-gateway-inference-fairness-id",  # headers unused: requests carry
        objective_header="x-gateway-inference-objective", default_tenant="default",  # their tenant
        objectives=section.objectives, default_priority=section.default_priority,
        anonymous_max_priority=section.default_priority, reserved_slots=variant.reserved_slots,
        input_weight=section.input_weight, output_weight=section.output_weight,
        locality_deficit=variant.locality_deficit, band_size=section.band_size, ttl_seconds=section.ttl_seconds)
    return FlowSpec(settings, variant.order, variant.patience, variant.patience_scale, variant.turn_waits)


def replica_room(fleet: Fleet, cost: CostModel) -> int:
    """Requests a simulated replica runs at once: its slots, or a paged server's max_running."""
    server = cost.server
    return server.max_running if server is not None and server.kv_cache == "paged" else fleet.slots


def flow_runs(source: Source, policies: Iterable[str], variants: list[Variant], seeds: Iterable[int],
              config: SimConfig, cost: CostModel, fleet: Fleet,
              progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every policy × variant × seed: its figures (tenant_figures) with its labels."""
    assert config.flow is not None  # load_sim_config reads [flow]
    runs = []
    for policy, variant, seed, outcome in flow_outcomes(source, policies, variants, seeds, config, cost, fleet):
        figures = tenant_figures(outcome.requests, config.flow)
        runs.append({"policy": policy, "variant": variant.label, "seed": seed, **figures})
        progress(f"{policy} {variant.label} seed {seed}: {len(outcome.requests)} requests, "
                 f"{outcome.end_s:.0f} simulated s")
    return runs


def flow_outcomes(source: Source, policies: Iterable[str], variants: list[Variant], seeds: Iterable[int],
                  config: SimConfig, cost: CostModel, fleet: Fleet) -> Iterator[tuple[str, Variant, int, Outcome]]:
    """Every seed × policy × variant, in that order: the run's outcome with its labels."""
    assert config.flow is not None  # load_sim_config reads [flow]
    for seed in seeds:
        for policy in policies:
            # the router is told the simulated replicas' room, as the stack tells it their --parallel
            base = with_knobs(config.routing, {"replicas.slots": replica_room(fleet, cost)})
            settings = parse_policy(policy, {**base, "hash_seed": seed} if source.seeds_hash else base)
            block_chars = make_policy(settings, settings.replicas).prefix_block_chars
            for variant in variants:
                spec = flow_spec(variant, config.flow)
                yield policy, variant, seed, run_once(source.make(seed, block_chars), settings, cost, fleet,
                                                      seed=seed, flow=spec)


def tenant_figures(requests: list[Request], section: SimFlowSection) -> dict[str, Any]:
    answered = [request for request in requests if request.status == 200]
    prompt = sum(request.prompt_tokens for request in answered)
    end = max((request.finished_at for request in requests), default=0.0)
    tenants: dict[str, Any] = {}
    for tenant in sorted({request.tenant for request in requests}):
        own = [request for request in requests if request.tenant == tenant]
        ttfts = sorted(request.first_token_at - request.arrived_at for request in own if request.status == 200)
        tenants[tenant] = {"p95_ttft_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
                           "answered": len(ttfts), "refused": sum(request.status in (429, 503) for request in own)}
    return {"tenants": tenants, "jain": mean_jain(requests, section),
            "cached_share": sum(request.cache_n for request in answered) / prompt if prompt else None,
            "tokens_per_s": sum(request.max_tokens for request in answered) / end if end else None}


def mean_jain(requests: list[Request], section: SimFlowSection) -> float:
    """Jain's index of the work started in the last 60 s by the tenants that had a request waiting
    (in the router or in a replica's queue), every 5 s from 60 s on, averaged."""
    events: list[tuple[float, str, float | None]] = []  # (at, tenant, work started, None: a request waits)
    for request in requests:
        if request.started_at > request.arrived_at + 1e-3:
            events += [(request.arrived_at, request.tenant, None), (request.started_at, request.tenant, None)]
        if request.status == 200:
            work = section.input_weight * request.prompt_n + section.output_weight * request.max_tokens
            events.append((request.started_at, request.tenant, work))
    events.sort(key=lambda event: event[0])
    window, samples = FairnessWindow(JAIN_WINDOW_S), []
    at = JAIN_WINDOW_S
    for when, tenant, started in events:
        while at < when:
            samples.append(window.jain(at))
            at += JAIN_EVERY_S
        if started is None:
            window.waited(when, tenant)
        else:
            window.served(when, tenant, started)
    return sum(samples) / len(samples) if samples else 1.0


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (policy, variant): mean and 95 % interval over seeds of every figure."""
    rows = []
    for policy, variant in dict.fromkeys((run["policy"], run["variant"]) for run in runs):
        own = [run for run in runs if run["policy"] == policy and run["variant"] == variant]
        tenants = {tenant: {figure: spread(None, [run["tenants"].get(tenant, {}).get(figure) for run in own])
                            for figure in ("p95_ttft_s", "answered", "refused")}
                   for tenant in sorted({tenant for run in own for tenant in run["tenants"]})}
        rows.append({"policy": policy, "variant": variant, "seeds": len(own), "tenants": tenants,
                     **{figure: spread(None, [run[figure] for run in own])
                        for figure in ("jain", "cached_share", "tokens_per_s")}})
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per variant, mean ± 95 % interval over seeds."""
    tenants = sorted({tenant for row in rows for tenant in row["tenants"]})
    several = len({row["policy"] for row in rows}) > 1
    head = (["policy"] if several else []) + ["queue"] + [f"p95 TTFT {tenant}" for tenant in tenants] + \
        ["Jain index", "cached share", "tokens/s"] + [f"refused {tenant}" for tenant in tenants]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = ([row["policy"]] if several else []) + [row["variant"]]
        cells += [_cell(row["tenants"][tenant]["p95_ttft_s"], "{:.3f} s") for tenant in tenants]
        cells += [_cell(row["jain"], "{:.3f}"), _cell(row["cached_share"], "{:.1%}"),
                  _cell(row["tokens_per_s"], "{:,.0f}")]
        cells += [_cell(row["tenants"][tenant]["refused"], "{:,.1f}") for tenant in tenants]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(stats: dict[str, Any], form: str) -> str:
    if stats["mean"] is None:
        return "-"
    return form.format(stats["mean"]) + ("" if stats["ci95"] is None else " ± " + form.format(stats["ci95"]))
