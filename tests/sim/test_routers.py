"""Several gateway routers: shared = one router, separate views split, affinity keeps conversations together."""

from __future__ import annotations

from collections import defaultdict

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
from extproc.sim.routers import ROUTER_STATES, RouterTier
from extproc.sim.runs import SIM_CONFIG, load_sim_config, run_once
from extproc.sim.workload import profile_workload
from extproc.traffic import load_profile
from tests.sim.helpers import settings as policy_settings
from tests.sim.helpers import simple_cost

QUICK, AGENT = load_profile("quick"), load_profile("agent")
FLEET = Fleet(3, 2, 4000, release_lag_s=0.02)  # releases come late, as from the access log


def rows(profile, policy: str, seed: int, routers: int = 1, state: str = "separate",
         store_lag_ms: float = 0.0) -> list[dict]:
    outcome = run_once(profile_workload(profile, seed), policy_settings(policy), simple_cost(), FLEET,
                       routers, state, seed, store_lag_ms)  # checks every router's ledger is empty at the end
    return request_rows(outcome.requests, "run", policy, seed)


def tier_run(profile, seed: int, routers: int, state: str, policy: str = "llm-aware") -> tuple[RouterTier, int]:
    tier = RouterTier(policy_settings(policy), routers, state, seed)
    outcome = simulate(profile_workload(profile, seed), tier, simple_cost(), FLEET)
    return tier, len(outcome.requests)


@pytest.mark.parametrize("policy", ["bounded", "llm-aware", "round-robin"])
def test_one_shared_router_behind_three_is_one_router(policy):
    assert rows(QUICK, policy, 4, 3, "shared") == rows(QUICK, policy, 4)


@pytest.mark.parametrize("policy", ["bounded", "llm-aware:speed_learning=false"])
def test_affinity_with_one_load_picture_is_one_router(policy):
    # each router holds the whole placement history of its conversations; the ledger is common
    # (learnt replica speeds are not: each router learns from the answers to its own requests)
    assert rows(AGENT, policy, 6, 3, "affinity-shared-load") == rows(AGENT, policy, 6)
    assert rows(AGENT, policy, 6, 3, "affinity") != rows(AGENT, policy, 6)  # the load picture matters


@pytest.mark.parametrize("policy", ["bounded", "llm-aware"])
def test_one_separate_router_is_the_plain_router(policy):
    plain = simulate(profile_workload(AGENT, 2), Router(policy_settings(policy)), simple_cost(), FLEET)
    assert rows(AGENT, policy, 2, 1, "separate") == request_rows(plain.requests, "run", policy, 2)


def test_separate_routers_split_the_view_and_lose_hits():
    one = rows(QUICK, "llm-aware", 4)
    three = rows(QUICK, "llm-aware", 4, 3, "separate")
    assert [r["replica"] for r in one] != [r["replica"] for r in three]
    cached = {n: sum(r["cache_n"] for r in result) for n, result in ((1, one), (3, three))}
    assert cached[3] < cached[1]  # a router that never saw a conversation's last turn cannot follow it


@pytest.mark.parametrize("state", ROUTER_STATES)
def test_requests_spread_over_every_router_and_load_returns_to_zero(state):
    tier, requests = tier_run(AGENT, 3, 3, state)  # agent: fan-out sides are requests of their own
    assert sum(tier.routed) == requests
    assert all(count > 0 for count in tier.routed), tier.routed
    assert tier.in_flight() == 0
    for router in tier.routers:
        assert router.in_flight() == 0 and router.ledger.total_requests() == router.ledger.total_tokens() == 0


def test_the_spread_is_fixed_by_the_seed():
    def spread(seed: int) -> list[int]:
        tier = RecordingTier(policy_settings("bounded"), 3, "separate", seed)
        simulate(profile_workload(QUICK, 1), tier, simple_cost(), FLEET)  # same traffic, other spread
        return [index for _, index in tier.picks]

    assert spread(7) == spread(7)
    assert spread(7) != spread(8)
    assert rows(QUICK, "llm-aware", 7, 3, "separate") == rows(QUICK, "llm-aware", 7, 3, "separate")


class RecordingTier(RouterTier):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.picks: list[tuple[str, int]] = []

    def pick(self, request: RouteRequest) -> int:
        index = super().pick(request)
        self.picks.append((request.conversation, index))
        return index


def routers_of_conversations(state: str) -> tuple[dict[str, set[int]], int]:
    """Which routers each conversation met (agent profile, seed 5), and how many requests there were."""
    tier = RecordingTier(policy_settings("llm-aware"), 3, state, 5)
    simulate(profile_workload(AGENT, 5), tier, simple_cost(), FLEET)
    met = defaultdict(set)
    for conversation, index in tier.picks:
        met[conversation].add(index)
    return met, len(tier.picks)


def test_affinity_sends_every_turn_of_a_conversation_to_one_router():
    met, requests = routers_of_conversations("affinity")
    assert all(len(indexes) == 1 for indexes in met.values())
    assert requests > len(met)  # conversations of several turns (and sides)
    assert {index for indexes in met.values() for index in indexes} == {0, 1, 2}


def test_separate_routers_send_a_conversation_through_several():
    met, _ = routers_of_conversations("separate")
    assert any(len(indexes) > 1 for indexes in met.values())


@hsettings(max_examples=15, deadline=None)
@given(st.integers(1, 4), st.sampled_from(ROUTER_STATES), st.integers(0, 10**6),
       st.sampled_from(["round-robin", "bounded", "llm-aware"]))
def test_every_router_ends_empty(count, state, seed, policy):
    scaled = Fleet(3, 2, 4000, scale=((20.0, 4), (60.0, 2)), release_lag_s=0.02)
    tier = RouterTier(policy_settings(policy), count, state, seed)
    workload = profile_workload(QUICK, seed % 50)
    outcome = simulate(ClosedLoop(workload.conversations, 4, workload.spawn_rate, 60.0), tier, simple_cost(), scaled)
    assert sum(tier.routed) == len(outcome.requests)
    assert all(router.in_flight() == 0 and router.ledger.total_tokens() == 0 for router in tier.routers)


def test_the_settings_are_required_and_checked(tmp_path):
    text = SIM_CONFIG.read_text()
    assert (load_sim_config().routers, load_sim_config().router_state) == (1, "separate")
    missing = tmp_path / "missing.toml"
    missing.write_text(text.replace("\nrouters = 1\n", "\n"))
    with pytest.raises(SettingsError, match=r"missing\.toml: gateway\.routers: missing"):
        load_sim_config(missing)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(text.replace('router_state = "separate"', 'router_state = "gossip"'))
    with pytest.raises(SettingsError, match="router_state: 'gossip' is not one of separate, shared, affinity, "):
        load_sim_config(wrong)


def test_bad_router_options_are_one_line(tmp_path, capsys):
    base = ["sim", "--profile", "quick", "--policies", "bounded", "--seeds", "1", "--out-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exited:
        main([*base, "--routers", "0"])
    assert exited.value.code == 2 and "--routers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main([*base, "--router-state", "gossip"])
    assert exited.value.code == 2 and "--router-state" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
