"""The paged-KV replica: a shared token pool, prefix sharing by block, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import extproc.sim.engine as engine
from extproc.routing import Router
from extproc.routing.blocks import covered_tokens
from extproc.sim.costmodel import CostModel, CostModelError, load_cost_model
from extproc.sim.engine import Fleet, OpenLoop, simulate
from extproc.sim.paged import BlockPool, PagedReplica
from extproc.sim.records import request_rows
from extproc.sim.request import Request
from extproc.sim.runs import load_sim_config
from tests.sim.helpers import POLICIES, settings, simple_cost


def paged_cost(capacity: int = 4096, max_running: int = 4, context: int = 2048) -> CostModel:
    server = {"kv_cache": "paged", "context_tokens": context, "kv_capacity_tokens": capacity,
              "block_tokens": 16, "max_running": max_running}
    return simple_cost(server=server)


def trace_request(name: str, blocks: tuple[int, ...], prompt: int, output: int, at: float) -> Request:
    return Request(name, name, 1, blocks[0], blocks, prompt, output, arrival_s=at)


def test_a_block_freed_longest_ago_is_evicted_first_tail_before_head():
    pool = BlockPool(2048)
    a = [(1, 512), (2, 512)]
    b = [(3, 512), (4, 512)]
    for blocks in (a, b):
        plan = pool.plan(blocks, 0)
        assert plan is not None
        pool.take(blocks, 0, plan[1])
        pool.give_back(blocks, 0)
    assert list(pool.free) == [2, 1, 4, 3]  # a before b; each request's tail first
    c = [(5, 512)]
    plan = pool.plan(c, 0)
    assert plan == (0, 512)
    pool.take(c, 0, plan[1])
    assert 2 not in pool and 1 in pool and pool.used == 2048  # a's tail went, its head stays
    assert pool.plan([(1, 512), (9, 512)], 0) == (512, 512)  # a's head still hits


def test_a_referenced_block_is_never_evicted_and_a_full_pool_waits():
    pool = BlockPool(1024)
    running = [(1, 512), (2, 512)]
    pool.take(running, 0, pool.plan(running, 0)[1])  # type: ignore[index]
    assert pool.plan([(3, 16)], 0) is None  # nothing evictable: the newcomer waits
    assert pool.plan([(1, 512)], 0) == (512, 0)  # sharing a running request's block costs nothing


def test_follow_up_hits_the_shared_prefix_on_the_same_replica():
    # a (3 blocks) then its follow-up (blocks 1, 2 then new ones) and an unrelated request.
    requests = [trace_request("a", (1, 2, 3), 1100, 5, 0.0), trace_request("x", (7,), 300, 5, 1.0),
                trace_request("b", (1, 2, 4, 5), 1600, 5, 30.0)]
    router = Router(settings("consistent"))
    done = {r.request_id: r for r in simulate(OpenLoop(requests), router, paged_cost(), Fleet(1, 1, 0)).requests}
    assert (done["b"].cache_n, done["b"].prompt_n) == (1024, 576)
    assert done["x"].cache_n == 0


def test_max_running_and_capacity_queue_requests_in_order():
    # capacity 1100: a (512 + 288 + 8 private rounded to 16 -> 816) leaves 284; b (816) waits for a.
    requests = [trace_request("a", (1, 2), 800, 8, 0.0), trace_request("b", (3, 4), 800, 8, 0.1)]
    router = Router(settings("round-robin"))
    done = {r.request_id: r for r in simulate(OpenLoop(requests), router, paged_cost(1100, 4, 1024),
                                              Fleet(1, 1, 0)).requests}
    assert done["b"].started_at == pytest.approx(done["a"].finished_at)


def test_longer_than_the_context_is_refused_at_once():
    requests = [trace_request("long", (1, 2, 3), 1200, 8, 0.0)]
    router = Router(settings("llm-aware"))
    outcome = simulate(OpenLoop(requests), router, paged_cost(4096, 4, 1000), Fleet(1, 1, 0))
    (long,) = outcome.requests
    assert (long.status, long.error, long.finished_at) == (400, "context length exceeded", 0.0)
    assert router.in_flight() == 0


def test_a_paged_cost_model_must_fit_its_context_in_its_pool():
    with pytest.raises(CostModelError, match="server.kv_capacity_tokens: must hold the longest request"):
        paged_cost(1024, 4, 1024)  # 1024 + 3 x 16 tokens of rounding do not fit 1024
    with pytest.raises(CostModelError, match="server.kv_cache"):
        simple_cost(server={"kv_cache": "radix", "context_tokens": 10})


def test_shipped_gpu_models_load_with_their_sources():
    for name, kind in (("llama31-8b-h100-vllm", "paged"), ("llama31-8b-rtx3090-llamacpp", "slots")):
        model = load_cost_model(name)
        assert model.server is not None and model.server.kv_cache == kind
        assert model.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
        assert model.measured["published"] and model.measured["derived_or_assumed"]


class WatchedReplica(PagedReplica):
    """Checks the pool after every change: never above capacity, accounting consistent."""

    def wake(self, now):  # type: ignore[no-untyped-def]
        finished = super().wake(now)
        self.check()
        return finished

    def arrive(self, request, now):  # type: ignore[no-untyped-def]
        started = super().arrive(request, now)
        self.check()
        return started

    def check(self) -> None:
        pool = self.pool
        held = sum(pool.sizes.values()) + sum(pool.free.values()) + sum(p for _, p in self.held.values())
        assert pool.used == held <= pool.capacity
        assert pool.free_tokens == sum(pool.free.values())
        assert len(self.held) == self.running <= self.max_running


traffic = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(1, 700), st.integers(1, 40), st.floats(0, 20)),
    min_size=1, max_size=30,
)


def run_paged(items, policy, replicas, capacity, max_running):  # type: ignore[no-untyped-def]
    requests = []
    for number, (family, depth, extra, output, at) in enumerate(items):
        blocks = tuple(family * 100 + i for i in range(depth))  # families share leading blocks
        prompt = 512 * (depth - 1) + min(extra, 512)
        requests.append(trace_request(f"q{number}", blocks, prompt, output, at))
    router = Router(settings(policy))
    cost = paged_cost(capacity, max_running, 2100)
    original = engine.PagedReplica
    engine.PagedReplica = WatchedReplica  # type: ignore[misc]
    try:
        outcome = simulate(OpenLoop(requests), router, cost, Fleet(replicas, 1, 0))
    finally:
        engine.PagedReplica = original  # type: ignore[misc]
    return requests, router, outcome


@hsettings(max_examples=40, deadline=None)
@given(traffic, st.sampled_from(POLICIES), st.integers(1, 3), st.integers(2196, 6000), st.integers(1, 4))
def test_conservation_capacity_and_determinism(items, policy, replicas, capacity, max_running):
    requests, router, outcome = run_paged(items, policy, replicas, capacity, max_running)
    ids = [r.request_id for r in outcome.requests]
    assert sorted(ids) == sorted(r.request_id for r in requests) and len(set(ids)) == len(ids)
    assert router.in_flight() == 0 and router.ledger.total_tokens() == 0
    for r in outcome.requests:
        assert r.status == 200 and r.cache_n + r.prompt_n == r.prompt_tokens and r.prompt_n >= 1
        assert r.arrived_at <= r.started_at <= r.first_token_at <= r.finished_at
    again = run_paged(items, policy, replicas, capacity, max_running)[2]
    assert request_rows(again.requests, "x", policy, 1) == request_rows(outcome.requests, "x", policy, 1)


def test_a_profile_turn_reuses_only_the_full_blocks_of_the_previous_prompt():
    # No hash ids (a profile): blocks are (conversation, index); turn 1's partial tail (700 - 512
    # tokens) is not the same content as turn 2's second block, so only 512 tokens hit.
    first = Request("t1", "c", 1, "c", None, 700, 10, arrival_s=0.0)
    second = Request("t2", "c", 2, "c", None, 1300, 10, arrival_s=50.0)
    router = Router(settings("consistent"))
    done = {r.request_id: r for r in simulate(OpenLoop([first, second]), router, paged_cost(), Fleet(1, 1, 0)).requests}
    assert (done["t2"].cache_n, done["t2"].prompt_n) == (512, 788)


def test_a_held_block_named_with_another_size_is_counted_as_stored():
    # Found by the property test above: a block id held with 512 tokens and named again with 100
    # (a partial tail with the same id). Planning counted 100, taking it freed 512 fewer tokens
    # than planned, and eviction then ran out of free blocks.
    pool = BlockPool(1000)
    pool.take([("b", 512), ("c", 400)], 0, 912)
    pool.give_back([("b", 512), ("c", 400)], 0)
    assert pool.plan([("b", 100), ("n", 500)], 0) is None  # 512 pinned + 500 new > 1000
    hit, add = pool.plan([("b", 100), ("n", 480)], 0)
    pool.take([("b", 100), ("n", 480)], 0, add)
    assert (hit, pool.used) == (100, 992) and pool.used <= pool.capacity


class ReportingRouter(Router):
    """Records every cached-token report it is given (the routing core is compiled: its
    methods are extended by a subclass, not patched on an instance)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.reports: list[tuple[str, str, int, int]] = []

    def report_cached(self, request, replica, predicted, cached, timings=None) -> None:  # noqa: ANN001
        self.reports.append((request.request_id, replica, predicted, cached))
        super().report_cached(request, replica, predicted, cached, timings)


def test_every_answer_reports_its_simulated_cache_n_to_the_router():
    """The simulator closes llm-aware's loop as the gateway does: each answer's cache_n goes back."""
    requests = [trace_request("a", (1, 2, 3), 1100, 5, 0.0), trace_request("b", (1, 2, 4, 5), 1600, 5, 30.0)]
    router = ReportingRouter(settings("llm-aware:prefix_index=true,prefix_feedback=true"))
    reports = router.reports
    done = {r.request_id: r for r in simulate(OpenLoop(requests), router, paged_cost(), Fleet(2, 1, 0)).requests}
    assert reports == [(name, done[name].replica, done[name].predicted_cached, done[name].cache_n) for name in "ab"]
    # b holds 3 full blocks, 2 of them a's: predicted as 2/3 of its prompt, found as 2 blocks of 512
    assert done["b"].replica == done["a"].replica
    assert (done["b"].predicted_cached, done["b"].cache_n) == (covered_tokens(1600, 3, 2), 2 * 512)


def test_the_simulated_index_believes_the_arena_pool_holds_what_it_does():
    """llm-aware's index is as large as the arena's KV pool: a larger one would keep conversations
    sticky to caches the pool has evicted, a smaller one forget what it still holds (on the arena,
    seed 1, both track within a block: about 435,700 of 436,000 tokens used on every replica)."""
    pool = load_cost_model("llama31-8b-h100-vllm").server
    assert pool is not None
    assert load_sim_config().routing["replicas"]["cache_tokens"] == pool.kv_capacity_tokens
