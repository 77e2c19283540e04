"""The routers' shared store (router_state "store"): lag 0 is one router, an endless lag is
separate routers, and in between each router sees its own writes at once and the others'
exactly ``store_lag_ms`` late."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from extproc.cli import main
from extproc.routing import Router
from extproc.settings import SettingsError
from extproc.sim.engine import ClosedLoop, Fleet, simulate
from extproc.sim.routers import RouterTier, Store
from extproc.sim.runs import SIM_CONFIG, load_sim_config
from extproc.sim.workload import profile_workload
from tests.sim.helpers import settings as policy_settings
from tests.sim.helpers import simple_cost
from tests.sim.test_routers import AGENT, QUICK, rows

NEVER_MS = 1e15  # later than any run ends: no router ever reads another's writes


def store_rows(profile, policy: str, seed: int, lag_ms: float) -> list[dict]:
    return rows(profile, policy, seed, 3, "store", lag_ms)


@pytest.mark.parametrize("policy", ["bounded", "llm-aware"])
@pytest.mark.parametrize("profile", [QUICK, AGENT], ids=["quick", "agent"])
def test_a_store_without_lag_is_one_router(profile, policy):
    assert store_rows(profile, policy, 3, 0.0) == rows(profile, policy, 3, 3, "shared") == rows(profile, policy, 3)


@pytest.mark.parametrize("policy", ["bounded", "llm-aware"])
def test_a_store_never_read_is_separate_routers(policy):
    assert store_rows(AGENT, policy, 4, NEVER_MS) == rows(AGENT, policy, 4, 3, "separate")


def test_a_lagging_store_misses_recent_decisions():
    exact = store_rows(AGENT, "llm-aware", 8, 0.0)
    late = store_rows(AGENT, "llm-aware", 8, 2000.0)  # fan-out sides arrive together: far inside 2 s
    assert [r["replica"] for r in late] != [r["replica"] for r in exact]


@hsettings(max_examples=15, deadline=None)
@given(st.integers(1, 4), st.floats(0, 500), st.integers(0, 10**6), st.sampled_from(["bounded", "llm-aware"]))
def test_every_router_ends_empty_whatever_the_lag(count, lag_ms, seed, policy):
    scaled = Fleet(3, 2, 4000, scale=((20.0, 4), (60.0, 2)), release_lag_s=0.02)
    tier = RouterTier(policy_settings(policy), count, "store", seed, lag_ms / 1000)
    workload = profile_workload(QUICK, seed % 50)
    outcome = simulate(ClosedLoop(workload.conversations, 4, workload.spawn_rate, 60.0), tier, simple_cost(), scaled)
    assert sum(tier.routed) == len(outcome.requests)
    assert all(router.in_flight() == 0 and router.ledger.total_tokens() == 0 for router in tier.routers)


REPLICAS = ("llm-0", "llm-1")
operations = st.lists(
    st.tuples(st.floats(0, 0.05), st.integers(0, 2), st.booleans(), st.sampled_from(REPLICAS), st.integers(1, 500)),
    max_size=60,
)


@hsettings(max_examples=60, deadline=None)
@given(operations, st.sampled_from([0.0, 0.01, 0.03, 1.0]))
def test_a_router_sees_its_own_writes_at_once_and_the_others_lag_late(ops, lag_s):
    """Charges and releases by three routers at random times: after each read, a router's
    ledger holds exactly its own charges plus the others' made at least ``lag_s`` before."""
    routers = [Router(policy_settings("bounded"), REPLICAS) for _ in range(3)]
    store = Store(routers, lag_s)
    for router in routers:
        router.ledger.set_replicas(REPLICAS)  # the store's ledgers start as the fleet does
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


@pytest.mark.parametrize(("line", "error"), [("\n", "missing setting 'store_lag_ms'"),
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
