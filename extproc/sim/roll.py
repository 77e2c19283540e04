"""A rolling restart in the simulator, with or without migration (docs/migration.md).

From ``at_s`` the replicas leave one at a time, in name order: out of the router's list,
drained (its running and queued requests finish), ``restart_s`` later back as a fresh server
with empty caches, and then the next one. With migration, what the leaving replica holds is
moved as the local stack moves it: its idle slots when it leaves, the others once drained
(a llama.cpp replica: only its slots, not its host-RAM cache; a paged one: every conversation
whose blocks its pool still holds), each conversation planned by the live planner
(extproc/migration/planner.py) with the cost model's KV bytes a token and prefill time
against ``transfer_bytes_per_second``. A move lands after its transfer time (the moves of one
replica one after another): a slot file restored into the receiver's least recently used idle
slot (its old content saved to the host cache, as llama.cpp does when a slot is reused), or
blocks added to the receiver's pool as cached, evictable blocks; then every router is told
(``Router.migrated``), so the conversation's next decision says ``+migrated``.

    llm-ring sim --trace FILE --cost-model M --replicas 8 --policies llm-aware --seeds 1-3 --roll-at S ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.migration.planner import Candidate, Costs, plan
from extproc.routing.hashing import stable_hash
from extproc.routing.policies import make_policy
from extproc.routing.ring import HashRing
from extproc.sim.costmodel import CostModel
from extproc.sim.engine import HOOK, Hook, _Simulation, simulate
from extproc.sim.paged import PagedReplica
from extproc.sim.replica import Replica
from extproc.sim.request import Request
from extproc.sim.routers import RouterTier
from extproc.sim.runs import parse_policy

POLL_S = 0.05  # how often a draining replica is looked at


@dataclass(frozen=True)
class RollSettings:
    at_s: float
    restart_s: float  # from drained to back, healthy
    migrate: bool
    transfer_bytes_per_second: float
    min_tokens: int


@dataclass
class RollLog:
    steps: list[dict[str, Any]] = field(default_factory=list)
    moved: int = 0
    moved_bytes: int = 0
    candidates: int = 0


def roll_hooks(settings: RollSettings, names: list[str], cost: CostModel, log: RollLog) -> list[tuple[float, Hook]]:
    return [(settings.at_s, _Rolling(settings, sorted(names), cost, log).leave)]


class _Rolling:
    def __init__(self, settings: RollSettings, order: list[str], cost: CostModel, log: RollLog) -> None:
        self.settings, self.order, self.cost, self.log = settings, order, cost, log
        self.index = 0
        self.moved: set[int] = set()  # keys moved off the replica now leaving

    @property
    def name(self) -> str:
        return self.order[self.index]

    def leave(self, sim: _Simulation, now: float) -> None:
        staying = [n for n, r in sim.replicas.items() if not r.draining and n != self.name]
        sim.replicas[self.name].draining = True
        sim.router.set_replicas(staying)
        self.log.steps.append({"replica": self.name, "out_s": now})
        self.moved = set()
        if self.settings.migrate:
            self._migrate(sim, staying, now)
        sim.push(now + POLL_S, HOOK, self.drained)

    def drained(self, sim: _Simulation, now: float) -> None:
        replica = sim.replicas[self.name]
        if replica.running or replica.queue:
            sim.push(now + POLL_S, HOOK, self.drained)
            return
        if self.settings.migrate:
            self._migrate(sim, [n for n, r in sim.replicas.items() if not r.draining], now)
        self.log.steps[-1]["drained_s"] = now
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

    def _migrate(self, sim: _Simulation, staying: list[str], now: float) -> None:
        leaving = sim.replicas[self.name]
        routers = sim.router.distinct() if isinstance(sim.router, RouterTier) else [sim.router]
        routing = routers[0].settings
        held = _held(leaving, sim.outcome.requests)
        keys = {stable_hash(r.conversation, routing.hash_seed): (r, tokens) for r, tokens in held}
        candidates = [Candidate(key, 0, tokens, r.order) for key, (r, tokens) in keys.items() if key not in self.moved]
        self.log.candidates += len(candidates)
        free = {n: _free_slots(sim.replicas[n]) for n in staying}
        per_token = self.cost.prefill_s(1000, 0) / 1000
        costs = Costs(self.cost.kv_bytes_per_token, per_token, self.settings.transfer_bytes_per_second)
        ring = HashRing(staying, routing.virtual_nodes, routing.hash_seed)
        at = now
        for move in plan(candidates, ring, free, costs, self.settings.min_tokens, 2**62):
            at += move.bytes / self.settings.transfer_bytes_per_second
            request, _ = keys[move.conversation_key]
            self.moved.add(move.conversation_key)
            sim.push(at, HOOK, _Restore(request, move.receiver, move.conversation_key, move.tokens, move.bytes,
                                        routers, self.log))


@dataclass
class _Restore:
    request: Request
    receiver: str
    key: int
    tokens: int
    bytes: int
    routers: list[Any]
    log: RollLog

    def __call__(self, sim: _Simulation, now: float) -> None:
        receiver = sim.replicas.get(self.receiver)
        if receiver is None or receiver.draining or not _restore(receiver, self.request, self.tokens, now):
            return  # a miss: the next turn is computed again
        for router in self.routers:
            router.migrated(self.key, self.receiver, self.request.prompt_tokens, self.request.route.prefix_blocks)
        self.log.moved += 1
        self.log.moved_bytes += self.bytes


def _held(replica: Replica | PagedReplica, finished: list[Request]) -> list[tuple[Request, int]]:
    """The conversations the leaving replica can hand over: (its last request there, tokens held)."""
    latest: dict[Any, Request] = {}
    for request in finished:
        if request.replica == replica.name and request.status == 200:
            latest[request.key] = request
    if isinstance(replica, PagedReplica):
        held = ((request, replica.pooled_prefix_tokens(request)) for request in latest.values())
        return [(request, tokens) for request, tokens in held if tokens]
    idle = {slot.key: slot.tokens for slot in replica.slots if not slot.busy and slot.tokens}
    return [(r, idle[r.key]) for r in latest.values() if r.key in idle]


def _free_slots(replica: Replica | PagedReplica) -> int:
    if isinstance(replica, PagedReplica):
        return 2**31  # the pool decides when the blocks arrive
    return sum(not slot.busy for slot in replica.slots)


def _restore(replica: Replica | PagedReplica, request: Request, tokens: int, now: float) -> bool:
    if isinstance(replica, PagedReplica):
        blocks, _ = replica._blocks(request)
        return replica.pool.add_cached(blocks)
    idle = [slot for slot in replica.slots if not slot.busy]
    if not idle:
        return False
    slot = min(idle, key=lambda s: s.last_used)
    if slot.tokens and replica.cache.capacity_tokens > 0:
        replica.cache.save(slot.key, slot.blocks, slot.tokens)
    slot.key, slot.blocks, slot.tokens, slot.last_used = request.key, request.blocks, tokens, now
    return True


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
    answered_before = _answered_before(outcome.requests, settings.at_s)
    return {"cost_model": cost.name, "migrate": settings.migrate, "roll_s": [round(begin, 1), round(end, 1)],
            **window_figures(outcome.requests, begin, end), "before": window_figures(answered_before, 0, settings.at_s),
            "candidates": log.candidates, "moved": log.moved, "moved_gb": round(log.moved_bytes / 1e9, 2)}


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
                workload = source.make(seed, make_policy(routing).prefix_block_chars)
                figures = simulate_roll(workload, routing, cost, fleet, replace(settings, migrate=migrate),
                                        config.routers, config.router_state, seed)
                runs.append({"policy": policy, "seed": seed, **figures})
                progress(json.dumps(runs[-1]))
    return runs


def render_rolls(runs: list[dict[str, Any]]) -> str:
    """One line per run: the roll window, its cached share and p95 TTFT, what moved."""
    lines = ["policy        seed  migration  roll window s    cached share  p95 TTFT s  moved (candidates)"]
    for run in runs:
        head = f"{run['policy']:<13} {run['seed']:>4}  {'on' if run['migrate'] else 'off':<9}  "
        if "error" in run:
            lines.append(head + run["error"])
            continue
        window = f"{run['roll_s'][0]:.0f}-{run['roll_s'][1]:.0f}"
        share = "-" if run["cached_share"] is None else f"{100 * run['cached_share']:.1f} %"
        ttft = "-" if run["p95_ttft_s"] is None else f"{run['p95_ttft_s']:.2f}"
        lines.append(f"{head}{window:<15}  {share:>12}  {ttft:>10}  {run['moved']} ({run['candidates']})")
    return "\n".join(lines)
