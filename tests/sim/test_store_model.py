"""The routers' shared store (router_state "store"): lag 0 is one router, an endless lag is
separate routers, and in between each router sees its own writes at once and the others'
exactly ``store_lag_ms`` late; with the handoff, a release by the next turn at once."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from extproc.cli import main
from extproc.routing import Router
from extproc.routing.decision import RouteRequest
from extproc.settings import SettingsError
from extproc.sim.engine import ClosedLoop, Fleet, simulate
from extproc.sim.records import request_rows
from extproc.sim.routers import RouterTier, Store
from extproc.sim.runs import SIM_CONFIG, load_sim_config, run_once
from extproc.sim.workload import profile_workload
from tests.sim.helpers import settings as policy_settings
from tests.sim.helpers import simple_cost
from tests.sim.test_routers import AGENT, FLEET, QUICK, rows

SLOW_PREFILL = simple_cost(prefill={"overhead_s": 0.0, "per_token_s": 0.03, "per_token_ctx_s": 0.0})
NEVER_MS = 1e15  # later than any run ends: no router ever reads another's writes


def store_rows(profile, policy: str, seed: int, lag_ms: float) -> list[dict]:
    return rows(profile, policy, seed, 3, "store", lag_ms)


ONE_PICTURE = ["bounded", "llm-aware:speed_learning=false", "llm-aware"]


@pytest.mark.parametrize("policy", ONE_PICTURE)
@pytest.mark.parametrize("profile", [QUICK, AGENT], ids=["quick", "agent"])
def test_a_store_without_lag_is_one_router(profile, policy):
    assert store_rows(profile, policy, 3, 0.0) == rows(profile, policy, 3, 3, "shared") == rows(profile, policy, 3)


def test_through_the_store_every_router_learns_the_speeds_of_every_answer():
    # replicas of two speeds: the learnt speeds steer decisions (a router learning only from its
    # own answers decided otherwise here, in 65 of the requests)
    mixed = Fleet(3, 2, 4000, release_lag_s=0.02, models=((simple_cost(), 4000), (SLOW_PREFILL, 4000)))
    workload = profile_workload(AGENT, 3)
    store = run_once(workload, policy_settings("llm-aware"), simple_cost(), mixed, 3, "store", 3, 0.0)
    one = run_once(profile_workload(AGENT, 3), policy_settings("llm-aware"), simple_cost(), mixed, 1, "separate", 3)
    assert request_rows(store.requests, "run", "llm-aware", 3) == request_rows(one.requests, "run", "llm-aware", 3)
    tier = RouterTier(policy_settings("llm-aware"), 3, "store", 3)
    simulate(profile_workload(AGENT, 3), tier, simple_cost(), mixed)
    tier.settle()
    learnt = [router.speeds for router in tier.routers]
    assert learnt[0].speeds() == learnt[1].speeds() == learnt[2].speeds() != learnt[0].prior
    assert learnt[0].answers == learnt[1].answers and sum(learnt[0].answers.values()) > sum(tier.routed) / 2


@pytest.mark.parametrize("policy", ["bounded", "llm-aware"])
def test_a_store_never_read_is_separate_routers(policy):
    assert store_rows(AGENT, policy, 4, NEVER_MS) == rows(AGENT, policy, 4, 3, "separate")


def test_a_lagging_store_misses_recent_decisions():
    exact = store_rows(AGENT, "llm-aware", 8, 0.0)
    late = store_rows(AGENT, "llm-aware", 8, 2000.0)  # fan-out sides arrive together: far inside 2 s
    assert [r["replica"] for r in late] != [r["replica"] for r in exact]


@hsettings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.floats(0, 500), st.booleans(), st.integers(0, 10**6),
       st.sampled_from(["bounded", "llm-aware"]))
def test_every_router_ends_empty_whatever_the_lag(count, lag_ms, handoff, seed, policy):
    scaled = Fleet(3, 2, 4000, scale=((20.0, 4), (60.0, 2)), release_lag_s=0.02)
    tier = RouterTier(policy_settings(policy), count, "store", seed, lag_ms / 1000, handoff)
    workload = profile_workload(QUICK, seed % 50)
    outcome = simulate(ClosedLoop(workload.conversations, 4, workload.spawn_rate, 60.0), tier, simple_cost(), scaled)
    assert sum(tier.routed) == len(outcome.requests)
    assert all(router.in_flight() == 0 and router.ledger.total("tokens") == 0 for router in tier.routers)
    assert all(not list(conversations.waiting()) for conversations in tier.held.values())


REPLICAS = ("llm-0", "llm-1")


def stored_routers(policy: str, replicas: tuple[str, ...], count: int, lag_s: float,
                   outage: tuple[float, float] | None = None) -> tuple[Store, list[Router]]:
    """``count`` routers writing to one store."""
    routers = [Router(policy_settings(policy), replicas) for _ in range(count)]
    return Store(routers, lag_s, outage), routers
operations = st.lists(
    st.tuples(st.floats(0, 0.05), st.integers(0, 2), st.booleans(), st.sampled_from(REPLICAS), st.integers(1, 500)),
    max_size=60,
)


@hsettings(max_examples=60, deadline=None)
@given(operations, st.sampled_from([0.0, 0.01, 0.03, 1.0]))
def test_a_router_sees_its_own_writes_at_once_and_the_others_lag_late(ops, lag_s):
    """Charges and releases by three routers at random times: after each read, a router's
    ledger holds exactly its own charges plus the others' made at least ``lag_s`` before."""
    store, routers = stored_routers("bounded", REPLICAS, 3, lag_s)
    made: list[tuple[float, int, str, str, int, bool]] = []  # (at, writer, request id, replica, tokens, release)
    now = 0.0
    for number, (step, writer, charge, replica, tokens) in enumerate(ops):
        now += step
        store.read(writer, now)
        expected = {name: 0 for name in REPLICAS}
        for at, by, _, name, n, release in made:
            if by == writer or at <= now - lag_s:
                expected[name] += -n if release else n
        assert dict(routers[writer].ledger.loads("tokens")) == expected
        own = [(rid, name, n) for at, by, rid, name, n, release in made if by == writer]
        open_charges = [c for c in own if sum(1 for x in own if x[0] == c[0]) == 1]  # charged, not released yet
        if charge or not open_charges:
            request_id = f"r{number}"
            routers[writer].ledger.charge(request_id, replica, tokens)
            made.append((now, writer, request_id, replica, tokens, False))
        else:
            request_id, name, n = open_charges[0]
            routers[writer].ledger.release(request_id)
            made.append((now, writer, request_id, name, n, True))


@pytest.mark.parametrize(("line", "error"), [("\n", r"sim\.toml: gateway\.store_lag_ms: missing"),
                                             ("\nstore_lag_ms = -1\n", "store_lag_ms: must be >= 0")])
def test_the_lag_is_a_required_setting(tmp_path, line, error):
    assert load_sim_config().store_lag_ms == 1.0
    config = tmp_path / "sim.toml"
    config.write_text(SIM_CONFIG.read_text().replace("\nstore_lag_ms = 1.0\n", line))
    with pytest.raises(SettingsError, match=error):
        load_sim_config(config)


def test_a_negative_lag_on_the_command_line_is_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as exited:
        main(["sim", "--profile", "quick", "--policies", "bounded", "--seeds", "1", "--out-dir", str(out),
              "--router-state", "store", "--store-lag-ms", "-5"])
    assert exited.value.code == 2 and "--store-lag-ms" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("policy", ONE_PICTURE)
def test_a_handoff_without_lag_is_one_router_too(policy):
    handoff = run_once(profile_workload(AGENT, 3), policy_settings(policy), simple_cost(), FLEET, 3, "store", 3,
                       0.0, store_handoff=True)
    assert request_rows(handoff.requests, "run", policy, 3) == rows(AGENT, policy, 3)


class Steered(RouterTier):
    """Each request meets the router its id names ("r1-..." -> router 1)."""

    def pick(self, request: RouteRequest) -> int:
        return int(request.request_id[1])


@pytest.mark.parametrize("handoff", [False, True])
def test_the_next_turn_on_another_router_sees_the_handoff_at_once_or_lag_late(handoff):
    tier = Steered(policy_settings("llm-aware"), 2, "store", 0, store_lag_s=1.0, store_handoff=handoff)
    tier.set_replicas(["llm-0", "llm-1", "llm-2"])
    tier.clock = lambda: 10.0
    ticket = tier.route(RouteRequest("r0-turn1", "c", 400, 8))
    assert ticket is not None
    first = ticket.decision
    tier.sent(ticket, 11)
    tier.clock = lambda: 20.0  # answered; the next turn (its body showing history 11) arrives at once, on router 1
    assert tier.answered("c", frozenset({11})) == ["r0-turn1"] and not ticket.held
    reader = tier.routers[1]
    tier.store.read(1, 20.0)  # what router 1 knows as it decides
    placement = reader.memory.get(reader.conversation_key("c"))
    if handoff:
        assert placement is not None and placement.replica == first.replica
        assert reader.ledger.total("requests") == 0
    else:  # the charge (10 s old) is read, its release and the placement (written now) are not
        assert placement is None and reader.ledger.loads("requests")[first.replica] == 1
    tier.store.read(1, 21.0)  # a lag later, the same either way
    assert reader.ledger.total("requests") == 0
    assert reader.memory.get(reader.conversation_key("c")).replica == first.replica


def test_a_placement_read_late_does_not_replace_a_newer_one():
    store, routers = stored_routers("llm-aware", ("llm-0", "llm-1"), 2, 1.0)
    store.read(1, 1.0)
    routers[1].memory.remember(7, "llm-1", 100)  # router 1, at 1.0
    store.read(0, 1.5)
    routers[0].memory.remember(7, "llm-0", 200)  # router 0, later, at 1.5
    store.read(0, 2.1)  # router 1's write (at 1.0) arrives now: the store already holds router 0's
    assert routers[0].memory.get(7) == ("llm-0", 200)
    store.read(1, 2.6)
    assert routers[1].memory.get(7) == ("llm-0", 200)  # and router 1 learns the newer one


@pytest.mark.parametrize("policy", ["bounded", "llm-aware"])
def test_a_store_down_for_the_whole_run_is_separate_routers(policy):
    down = run_once(profile_workload(AGENT, 4), policy_settings(policy), simple_cost(), FLEET, 3, "store", 4,
                    1.0, store_outage=(0.0, float("inf")))
    assert request_rows(down.requests, "run", policy, 4) == rows(AGENT, policy, 4, 3, "separate")


def test_an_outage_loses_writes_and_the_return_drops_what_they_left_behind():
    store, routers = stored_routers("bounded", ("llm-0", "llm-1"), 2, 0.5, outage=(3.0, 5.0))
    store.read(0, 1.0)
    routers[0].ledger.charge("before", "llm-0", 10)
    store.read(1, 2.0)
    assert routers[1].ledger.loads("tokens") == {"llm-0": 10, "llm-1": 0}
    store.read(0, 3.5)  # the store is down: this release and this charge never reach it
    routers[0].ledger.release("before")
    routers[0].ledger.charge("during", "llm-1", 7)
    store.read(1, 4.5)  # down: router 1 routes on what it had
    assert routers[1].ledger.loads("tokens") == {"llm-0": 10, "llm-1": 0}
    store.read(1, 6.0)  # back: router 0 has written its requests in flight again
    assert routers[1].ledger.loads("tokens") == {"llm-0": 0, "llm-1": 7}
    store.read(0, 6.5)
    routers[0].ledger.release("during")
    store.read(1, 7.5)
    assert routers[1].ledger.total("tokens") == 0


@hsettings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.floats(0, 100), st.booleans(), st.floats(0, 80), st.floats(0, 80), st.integers(0, 10**6))
def test_every_router_ends_empty_whatever_the_outage(count, lag_ms, handoff, at_s, seconds, seed):
    outage = (at_s, at_s + seconds)
    tier = RouterTier(policy_settings("llm-aware"), count, "store", seed, lag_ms / 1000, handoff, outage)
    workload = profile_workload(QUICK, seed % 50)
    outcome = simulate(ClosedLoop(workload.conversations, 4, workload.spawn_rate, 60.0), tier, simple_cost(), FLEET)
    assert sum(tier.routed) == len(outcome.requests)
    assert all(router.in_flight() == 0 and router.ledger.total("tokens") == 0 for router in tier.routers)
    assert all(not list(conversations.waiting()) for conversations in tier.held.values())


@pytest.mark.parametrize("value", ["30", "5:-1", "30:x"])
def test_a_bad_outage_on_the_command_line_is_one_line(tmp_path, capsys, value):
    out = tmp_path / "o"
    code = main(["sim", "--profile", "quick", "--policies", "bounded", "--seeds", "1", "--out-dir", str(out),
                 "--router-state", "store", "--store-outage", value])
    error = capsys.readouterr().err
    assert code == 2 and "--store-outage" in error and error.count("\n") == 1
    assert not out.exists()


def test_through_the_store_every_router_holds_every_routers_prompts_in_its_prefix_index():
    # without lag in the same order; with a lag, two prompts sharing a block sent by two routers
    # within it may be made in either order (the block's weight is the first one's)
    tier = RouterTier(policy_settings("llm-aware"), 3, "store", 5, 0.0, True)
    simulate(profile_workload(AGENT, 5, tier.routers[0].policy.prefix_block_chars), tier, simple_cost(), FLEET)
    tier.settle()
    indexes = [router.policy.index for router in tier.routers]
    held = [{name: (index.used(name), index.size(name)) for name in router.replicas}
            for index, router in zip(indexes, tier.routers, strict=True)]
    assert held[0] == held[1] == held[2] and sum(size for _, size in held[0].values()) > 0
    assert all(count > 0 for count in tier.routed)  # each router sent part of them


def test_a_sim_toml_naming_the_removed_next_turn_setting_is_refused_by_name(tmp_path):
    # the simulated routers release by the next turn as the gateway does: no setting turns it off
    config = tmp_path / "sim.toml"
    config.write_text(SIM_CONFIG.read_text().replace("[gateway]\n", "[gateway]\nrelease_by_next_turn = false\n"))
    with pytest.raises(SettingsError, match=r"gateway\.release_by_next_turn: unknown setting"):
        load_sim_config(config)


def test_nothing_of_the_simulator_runs_inside_a_routers_calls():
    # the store model reads each router's journals after its calls: route, release and report stay in the core
    tier = RouterTier(policy_settings("llm-aware"), 2, "store", 1)
    tier.set_replicas(["llm-0", "llm-1"])
    router = tier.routers[0]
    called: set[str] = set()

    def watch(frame, event, _):  # noqa: ANN001, ANN202
        if event == "call":
            called.add(frame.f_code.co_filename)

    sys.setprofile(watch)
    try:
        ticket = router.route(RouteRequest("r1", "c", 400, 8, tuple(range(4))))
        assert ticket is not None
        router.report_cached(ticket.request, ticket.decision.replica, 0, 0)
        ticket.release()
        router.migrated(ticket.key, "llm-1", 400)
    finally:
        sys.setprofile(None)
    assert called and not [name for name in called if f"{os.sep}sim{os.sep}" in name]
    assert router.ledger.journal and router.memory.journal  # what the store reads after the calls
