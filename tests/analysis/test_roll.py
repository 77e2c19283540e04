"""`python -m extproc.analysis.roll`: the follow-ups of the conversations whose replica left, and
why each one that missed did."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from extproc.analysis.roll import main, roll_figures
from extproc.records import write_records

T0 = 1_800_000_000.0


def row(conversation: str, turn: int, at: float, replica: str, cache_n: int, prompt_n: int,
        reason: str = "home") -> dict:
    return {"run_id": "r", "policy": "llm-aware", "seed": 1, "simulated": False, "conversation": conversation,
            "turn": turn, "replica": replica, "route_reason": reason, "cache_n": cache_n, "prompt_n": prompt_n,
            "latency_s": 1.0, "status": 200, "started_at": T0 + at, "finished_at": T0 + at + 1}


def iso(at: float) -> str:
    return datetime.fromtimestamp(T0 + at, UTC).isoformat()


def test_each_missed_follow_up_of_a_left_replica_gets_its_cause(tmp_path: Path) -> None:
    steps = [{"replica": "llm-2", "out": iso(10), "drained": iso(12), "down": iso(13), "migration": {"succeeded": 2}}]
    (tmp_path / "run.json").write_text(json.dumps({"extra": {"roll": {"migrate": True, "scale_in": True,
                                                                       "replicas": steps}}}))
    write_records([
        row("hit", 1, 1, "llm-2", 0, 300), row("hit", 2, 14, "llm-0", 300, 20, "sticky+migrated"),
        row("told", 1, 2, "llm-2", 0, 300), row("told", 2, 15, "llm-1", 17, 320, "home+migrated"),
        row("early", 1, 3, "llm-2", 0, 300), row("early", 2, 11, "llm-1", 17, 320),
        row("lost", 1, 4, "llm-2", 0, 300), row("lost", 2, 16, "llm-0", 17, 320),
        row("elsewhere", 1, 5, "llm-0", 0, 300), row("elsewhere", 2, 17, "llm-0", 300, 20),  # not on llm-2
        row("stayed", 1, 6, "llm-2", 0, 300), row("stayed", 2, 11.5, "llm-2", 300, 20),  # during the drain, there
    ], tmp_path / "requests.parquet")
    figures = roll_figures(tmp_path)
    assert figures["scale_in"] and figures["rolled_follow_ups"] == 5 and figures["follow_up_hits"] == 2
    assert figures["misses"] == {"migrated": 1, "early": 1, "not moved": 1}
    assert figures["during_drain"] == {"follow_ups": 2, "hits": 1, "on_leaving": 1}  # "early" and "stayed"
    assert figures["requests_around_roll"] == 8 and figures["moved"] == 2  # started 5 s before out to 5 s after down


def test_a_folder_that_is_missing_or_holds_no_run_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"python -m extproc.analysis.roll: {tmp_path / 'nowhere'}: no such folder\n"
    assert main([str(tmp_path)]) == 2
    assert "no run (a folder with requests.parquet)" in capsys.readouterr().err
