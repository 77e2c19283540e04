"""A rolling restart in the simulator: every replica leaves and comes back once; with
migration the conversations it held continue cached on their receivers."""

from __future__ import annotations

from extproc.routing.policies import make_policy
from extproc.sim.costmodel import load_cost_model
from extproc.sim.roll import RollSettings, simulate_roll
from extproc.sim.runs import load_sim_config, parse_policy, profile_source


def rolled(migrate: bool, transfer: float = 1e9, profile: str = "quick", at_s: float = 8.0) -> dict:
    config = load_sim_config()
    cost = load_cost_model("smollm2-135m")
    routing = parse_policy("llm-aware", config.routing)
    source = profile_source(profile)
    fleet = config.fleet(3, cost)
    workload = source.make(1, make_policy(routing, routing.replicas).prefix_block_chars)
    return simulate_roll(workload, routing, cost, fleet, RollSettings(at_s, 2.0, migrate, transfer, 16))


def test_migration_moves_the_leaving_replicas_slots_and_their_next_turns_say_so() -> None:
    without, with_migration = rolled(False), rolled(True)
    assert "error" not in without and "error" not in with_migration
    assert without["moved"] == 0 and without["migrated_decisions"] == 0
    assert with_migration["moved"] >= 1 and with_migration["migrated_decisions"] >= 1
    assert with_migration["cached_share"] > without["cached_share"]
    assert with_migration["before"] == without["before"]  # nothing differs before the roll


def test_a_transfer_slower_than_prefill_moves_nothing() -> None:
    slow = rolled(True, transfer=1.0)  # 1 byte/s: recomputing is always cheaper
    assert slow["candidates"] >= 1 and slow["moved"] == 0


def test_llm_ring_sim_rolls_each_seed_without_and_with_migration(tmp_path, capsys) -> None:
    import json

    from extproc.cli import main

    out = tmp_path / "roll"
    assert main(["sim", "--profile", "quick", "--policies", "llm-aware", "--seeds", "1", "--roll-at", "8",
                 "--restart-s", "2", "--transfer-gb-per-s", "1", "--out-dir", str(out)]) == 0
    runs = json.loads((out / "roll.json").read_text())["replicas"]["3"]
    assert [run["migrate"] for run in runs] == [False, True]
    assert runs[0]["moved"] == 0 < runs[1]["moved"]
    assert "cached share" in capsys.readouterr().out
    for bad in (["--restart-s", "2"], ["--roll-at", "0"], ["--roll-at", "8", "--scale-at", "5"]):
        assert main(["sim", "--profile", "quick", "--policies", "llm-aware", "--seeds", "1", *bad,
                     "--out-dir", str(tmp_path / "bad")]) == 2


def test_agent_follow_ups_during_the_drain_go_to_the_leaving_replica_until_their_cache_moved() -> None:
    """Agent loops: requests in flight when a replica leaves, their next turns at once (issue 40)."""
    without, with_migration = rolled(False, profile="agent", at_s=10.0), rolled(True, profile="agent", at_s=10.0)
    assert without["follow_ups"] >= 3 and without["follow_up_hits"] == 0  # out of the list: each one cold
    assert with_migration["follow_up_hits"] >= 0.9 * with_migration["follow_ups"] > 0
    phases = [step["follow_ups_by_phase"] for step in with_migration["steps"]]
    sent = [(step["replica"], where) for step, by_phase in zip(with_migration["steps"], phases, strict=True)
            for where in by_phase.get("before move", {})]
    assert sent and all(replica == where for replica, where in sent)  # before the move: the leaving one
    for step in with_migration["steps"]:
        assert step["out_s"] <= step["down_s"] <= step["out_s"] + 60.0  # within the drain bound
