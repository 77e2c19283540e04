"""Every decision of every policy, field by field, as recorded (tests/routing/data/decisions.json.gz,
by decision_log.record): a change of code that moves no rule changes no decision and no trace.
A rule changed on purpose is re-recorded with it (decision_log.record), so the diff shows it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from extproc.routing import Router
from tests.routing.conftest import routing
from tests.routing.decision_log import CASES, REPLICAS, decisions

RECORDED = Path(__file__).parent / "data" / "decisions.json.gz"


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[dict]]:
    return json.loads(gzip.decompress(RECORDED.read_bytes()))


@pytest.mark.parametrize(("label", "knobs"), CASES, ids=[label for label, _ in CASES])
def test_decisions_as_recorded(recorded: dict[str, list[dict]], label: str, knobs: dict) -> None:
    # through JSON as recorded: tuples become lists, float keys strings
    now = json.loads(json.dumps(decisions(Router(routing(**knobs), REPLICAS)), sort_keys=True))
    before = recorded[label]
    assert len(now) == len(before)
    for number, (new, old) in enumerate(zip(now, before, strict=True)):
        assert new == old, f"{label}: decision {number} differs"
