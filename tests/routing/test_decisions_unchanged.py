"""Every decision of every policy, field by field, as the policies made them before they became
plugins (tests/routing/data/decisions.json.gz, recorded by decision_log.record on that code):
the move of their parameters, reasons and registry changed no decision and no trace."""

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
