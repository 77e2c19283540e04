"""A rolling restart in the simulator, with or without migration (docs/migration.md).

From ``at_s`` the replicas leave one at a time, in name order, and come back ``restart_s`` after
they went down as a fresh server with empty caches, and then the next one. Without migration a
leaving replica is out of the router's list at once and goes down once drained (its running and
queued requests finish). With migration it leaves in the order of extproc/routing/leaving.py
(drain.py): it still serves the follow-ups of the conversations it holds until their caches have
moved (a llama.cpp replica: only its slots, not its host-RAM cache; a paged one: every
conversation whose blocks its pool still holds), within ``drain_s``. Follow-ups are counted from
the moment the replica began leaving (``follow_ups``).

    llm-ring sim --trace FILE --cost-model M --replicas 8 --policies llm-aware --seeds 1-3 --roll-at S ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.routing.policies import make_policy
from extproc.sim.costmodel import CostModel
from extproc.sim.drain import DrainSettings, DrainWindow, MoveCounts
from extproc.sim.engine import HOOK, Hook, _Simulation, simulate
from extproc.sim.request import Request
from extproc.sim.routers import RouterTier
from extproc.sim.runs import parse_policy

POLL_S = 0.05  # how often a draining replica is looked at


@dataclass(frozen=True)
class RollSettings:
    at_s: float
    restart_s: float  # from down to back, healthy
    migrate: bool
    transfer_bytes_per_second: float
    min_tokens: int
    drain_s: float = 60.0  # the bound on one replica's drain and moves (the stack's migration.drain_seconds)
    near_s: float = 10.0  # unmoved follow-ups stop going to the leaving replica this long before that bound


@dataclass
class RollLog:
    steps: list[dict[str, Any]] = field(default_factory=list)
    counts: MoveCounts = field(default_factory=MoveCounts)


def roll_hooks(settings: RollSettings, names: list[str], cost: CostModel, log: RollLog) -> list[tuple[float, Hook]]:
    return [(settings.at_s, _Rolling(settings, sorted(names), cost, log).leave)]


class _Rolling:
    def __init__(self, settings: RollSettings, order: list[str], cost: CostModel, log: RollLog) -> None:
        self.settings, self.order, self.cost, self.log = settings, order, cost, log
        self.index = 0
        self.window: DrainWindow | None = None
        s = settings
        self.drain = DrainSettings(s.transfer_bytes_per_second, s.min_tokens, s.drain_s, s.near_s)

    @property
    def name(self) -> str:
        return self.order[self.index]

    def leave(self, sim: _Simulation, now: float) -> None:
        staying = [n for n, r in sim.replicas.items() if not r.draining and n != self.name]
        sim.replicas[self.name].draining = True
        self.log.steps.append({"replica": self.name, "out_s": now})
        if self.settings.migrate:  # stays in the router's list for the conversations it holds
            self.window = DrainWindow(sim, self.name, staying, now, self.drain, self.cost, self.log.counts)
        else:
            sim.router.set_replicas(staying)
        sim.push(now + POLL_S, HOOK, self.drained)

    def drained(self, sim: _Simulation, now: float) -> None:
        replica = sim.replicas[self.name]
        down = self.window.poll(now) if self.window is not None else not (replica.running or replica.queue)
        if not down:
            sim.push(now + POLL_S, HOOK, self.drained)
            return
        sim.router.set_replicas([n for n, r in sim.replicas.items() if not r.draining])
        self.log.steps[-1]["down_s"] = now
        if self.window is not None:
            self.log.steps[-1]["phases"] = self.window.order.phases()
            self.window = None
        sim.push(now + self.settings.restart_s, HOOK, self.back)

    def back(self, sim: _Simulation, now: float) -> None:
        fresh = sim._new_replica(self.name)
        fresh.host_factor = sim.host_factor
        sim.replicas[self.name] = fresh
        sim.every_replica.append(fresh)
        sim.router.set_replicas([n for n, r in sim.replicas.items() if not r.draining])
        self.log.steps[-1]["back_s"] = now
        self.index += 1
        if self.index < len(self.order):
            sim.push(now, HOOK, self.leave)


def follow_ups(requests: list[Request], steps: list[dict[str, Any]]) -> dict[str, int]:
    """The follow-ups of the conversations each leaving replica held, counted from the moment it
    began leaving: a conversation whose last turn before then went there, its first turn after;
    a hit when it found at least half the previous turn's prompt cached."""
    turns: dict[str, list[Request]] = {}
    for request in sorted((r for r in requests if r.status == 200), key=lambda r: r.arrived_at):
        turns.setdefault(request.conversation, []).append(request)
    counted = hits = 0
    for step in steps:
        out = step["out_s"]
        for conversation in turns.values():
            before = [r for r in conversation if r.arrived_at < out]
            after = next((r for r in conversation if r.arrived_at >= out), None)
            if before and after is not None and before[-1].replica == step["replica"]:
                counted += 1
                hits += after.cache_n >= before[-1].prompt_tokens / 2
    return {"follow_ups": counted, "follow_up_hits": hits}


def window_figures(requests: list[Request], begin_s: float, end_s: float) -> dict[str, Any]:
    """Cached share of prompt tokens and p95 TTFT of the requests that arrived in [begin, end)."""
    inside = [r for r in requests if begin_s <= r.arrived_at < end_s and r.status == 200]
    prompt = sum(r.prompt_tokens for r in inside)
    ttfts = sorted(r.first_token_at - r.arrived_at for r in inside)
    return {"requests": len(inside), "cached_share": sum(r.cache_n for r in inside) / prompt if prompt else None,
            "p95_ttft_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
            "migrated_decisions": sum("+migrated" in (r.reason or "") for r in inside)}


def _answered_before(requests: list[Request], at_s: float) -> list[Request]:
    return [r for r in requests if r.first_token_at is not None and r.first_token_at < at_s]


def simulate_roll(workload: Any, routing: Any, cost: CostModel, fleet: Any, settings: RollSettings,
                  routers: int = 1, router_state: str = "separate", seed: int = 0) -> dict[str, Any]:
    """One run with a roll: the roll's window figures (from the first replica out to the last one
    back), those of the requests answered before the roll began (what happens from then on, the
    drain and its migration included, may change the rest), and what moved."""
    log = RollLog()
    tier = RouterTier(routing, routers, router_state, seed)
    outcome = simulate(workload, tier, cost, fleet, roll_hooks(settings, fleet.names(fleet.replicas), cost, log))
    if not log.steps or "back_s" not in log.steps[-1]:
        return {"migrate": settings.migrate, "error": "the roll did not finish within the run"}
    begin, end = log.steps[0]["out_s"], log.steps[-1]["back_s"]
    counts = log.counts
    answered_before = _answered_before(outcome.requests, settings.at_s)
    return {"cost_model": cost.name, "migrate": settings.migrate, "roll_s": [round(begin, 1), round(end, 1)],
            **window_figures(outcome.requests, begin, end), "before": window_figures(answered_before, 0, settings.at_s),
            **follow_ups(outcome.requests, log.steps), "candidates": counts.candidates, "moved": counts.moved,
            "moved_gb": round(counts.moved_bytes / 1e9, 2),
            "steps": [{k: v for k, v in step.items() if k != "phases"} | _phase_counts(step) for step in log.steps]}


def _phase_counts(step: dict[str, Any]) -> dict[str, Any]:
    """Per leaving replica, its follow-ups by phase and where they went, and what it left unmoved."""
    phases = step.get("phases")
    if phases is None:
        return {}
    by_phase: dict[str, dict[str, int]] = {}
    for _, _, phase, replica in phases["follow_ups"]:
        where = by_phase.setdefault(phase, {})
        where[replica] = where.get(replica, 0) + 1
    return {"follow_ups_by_phase": by_phase, "moves": sum(e[2] == "moved" for e in phases["events"]),
            "unmoved": len(phases["unmoved"])}


def roll_runs(source: Any, policies: list[str], seeds: list[int], config: Any, cost: CostModel, replicas: int,
              settings: RollSettings, progress: Any) -> list[dict[str, Any]]:
    """Per policy and seed, the run without and then with migration (the same seed: the same
    arrivals and ring); each run's figures as ``simulate_roll`` gives them, with its seed and policy."""
    paged = cost.server is not None and cost.server.kv_cache == "paged"
    fleet = config.fleet(replicas, cost, cache=not paged)
    runs = []
    for policy in policies:
        for seed in seeds:
            base = {**config.routing, "hash_seed": seed} if source.seeds_hash else config.routing
            routing = parse_policy(policy, base)
            for migrate in (False, True):
                workload = source.make(seed, make_policy(routing, routing.replicas).prefix_block_chars)
                figures = simulate_roll(workload, routing, cost, fleet, replace(settings, migrate=migrate),
                                        config.routers, config.router_state, seed)
                runs.append({"policy": policy, "seed": seed, **figures})
                progress(json.dumps(runs[-1]))
    return runs


def render_rolls(runs: list[dict[str, Any]]) -> str:
    """One line per run: the roll window, its cached share and p95 TTFT, what moved."""
    lines = ["policy        seed  migration  roll window s    cached share  p95 TTFT s  follow-ups hit  "
             "moved (candidates)"]
    for run in runs:
        head = f"{run['policy']:<13} {run['seed']:>4}  {'on' if run['migrate'] else 'off':<9}  "
        if "error" in run:
            lines.append(head + run["error"])
            continue
        window = f"{run['roll_s'][0]:.0f}-{run['roll_s'][1]:.0f}"
        share = "-" if run["cached_share"] is None else f"{100 * run['cached_share']:.1f} %"
        ttft = "-" if run["p95_ttft_s"] is None else f"{run['p95_ttft_s']:.2f}"
        hit = f"{run['follow_up_hits']} of {run['follow_ups']}"
        lines.append(f"{head}{window:<15}  {share:>12}  {ttft:>10}  {hit:>14}  {run['moved']} ({run['candidates']})")
    return "\n".join(lines)
