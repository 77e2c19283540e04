"""A rolling restart in the simulator: every replica leaves and comes back once; with
migration the conversations it held continue cached on their receivers."""

from __future__ import annotations

from extproc.routing.policies import make_policy
from extproc.sim.costmodel import load_cost_model
from extproc.sim.roll import RollSettings, simulate_roll
from extproc.sim.runs import load_sim_config, parse_policy, profile_source


def rolled(migrate: bool, transfer: float = 1e9) -> dict:
    config = load_sim_config()
    cost = load_cost_model("smollm2-135m")
    routing = parse_policy("llm-aware", config.routing)
    source = profile_source("quick")
    fleet = config.fleet(3, cost)
    workload = source.make(1, make_policy(routing).prefix_block_chars)
    return simulate_roll(workload, routing, cost, fleet, RollSettings(8.0, 2.0, migrate, transfer, 16))


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
