"""`llm-ring bench decisions` covers every policy: ours at each fleet, the peers at 64 replicas
with prefix blocks (a smoke run: what is timed is not asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import extproc
from extproc import cli
from extproc.bench import decisions
from extproc.routing import POLICIES


def test_the_table_has_every_policy_and_the_peers_at_64_replicas(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decisions, "bytes_per_conversation", lambda: 120.0)  # its own 200,000 entries: slow
    monkeypatch.setattr(decisions, "bytes_per_block", lambda: 400.0)
    assert decisions.main(argparse.Namespace(decisions=300, fleets=[3], json=True)) == 0
    summary = json.loads(capsys.readouterr().out)
    cells = {(row["policy"], row["replicas"]) for row in summary["decisions"]}
    peers = {"prefix-affinity", "radix-balance", "chwbl", "kv-cost"}
    assert cells == ({(name, 3) for name in POLICIES if name not in peers} | {(name, 64) for name in peers}
                     | {(decisions.PREFIX_INDEX, 64)})
    assert 1_300 < summary["block_hashing"]["prompt_tokens"] < 2_200
    hashing = summary["block_hashing"]
    assert hashing["prefix_index"]["block_chars"] == 4 * hashing["peers"]["block_chars"]  # the index's coarser blocks
    index_blocks, peer_blocks = hashing["prefix_index"]["blocks"], hashing["peers"]["blocks"]
    assert 4 * (index_blocks - 1) < peer_blocks <= 4 * index_blocks
    assert hashing["prefix_index"]["next_turn_median_us"] > 0  # a next turn: its new blocks only
    assert summary["core"] == extproc.CORE
    versus = summary["compiled_against_python"]
    if extproc.CORE == "compiled":  # the index's figures again with the core run as Python, side by side
        assert set(versus) == {"median_us", "hashing_us", "next_turn_us"}
        assert all(row["compiled"] > 0 and row["python"] > 0 and row["ratio"] > 0 for row in versus.values())
    else:
        assert versus is None


def test_against_another_checkout_times_every_cell_on_both_sides_in_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    here = Path(extproc.__file__).resolve().parent.parent  # this checkout against itself: two real workers
    args = argparse.Namespace(decisions=200, fleets=[3], json=True, against=str(here), rounds=2)
    assert decisions.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["against"] == str(here) and summary["rounds"] == 2
    assert [(row["policy"], row["replicas"]) for row in summary["cells"]] == decisions.bench_cells([3])
    for row in summary["cells"]:
        assert row["here_us"] > 0 and row["other_us"] > 0
        assert row["lowest"] <= row["ratio"] <= row["highest"]


def test_against_a_folder_that_is_no_checkout_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "decisions", "--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--against {tmp_path}: not an llm-ring checkout" in err


def test_against_a_checkout_whose_core_cannot_load_names_the_worker_and_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    (broken / "extproc" / "bench").mkdir(parents=True)
    (broken / "extproc" / "__init__.py").write_text("raise SystemExit('llm-ring: the routing core is stale')\n")
    (broken / "extproc" / "bench" / "__init__.py").write_text("")
    (broken / "extproc" / "bench" / "decisions.py").write_text("")
    assert cli.main(["bench", "decisions", "--fleets", "3", "--decisions", "100", "--against", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the worker of {broken} did not start: llm-ring: the routing core is stale" in err


def test_against_with_no_pairs_is_refused_before_anything_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    here = Path(extproc.__file__).resolve().parent.parent
    assert cli.main(["bench", "decisions", "--against", str(here), "--rounds", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith("--rounds: 0 is not a positive number of pairs")
