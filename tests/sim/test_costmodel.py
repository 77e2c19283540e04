"""Cost models: the formulas, the slowdown tables, and errors that name the field."""

from __future__ import annotations

import pytest

from extproc.sim.costmodel import CostModelError, load_cost_model, parse_cost_model
from tests.sim.helpers import simple_cost


def test_formulas_and_extended_slowdowns():
    cost = simple_cost(prefill={"overhead_s": 0.5, "per_token_s": 0.01, "per_token_ctx_s": 0.001},
                       concurrency={"prefill_slowdown": [1.0, 1.5], "decode_slowdown": [1.0]})
    assert cost.prefill_s(10, 100) == pytest.approx(0.5 + 0.1 + 10 * 105 * 0.001)
    assert cost.decode_s(10, 0) == pytest.approx(1.0)
    prefill, decode = cost.slowdowns(4)
    assert prefill == (0.0, 1.0, 1.5, 2.0, 2.5)  # measured up to 2 slots, then the last step again
    assert decode == (0.0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize(("change", "message"), [
    ({"decode": {"per_token_s": 0.1}}, "decode.per_token_ctx_s: missing"),
    ({"concurrency": {"prefill_slowdown": [0.5], "decode_slowdown": [1]}}, "concurrency.prefill_slowdown: must be"),
    ({"kv_bytes_per_token": 0}, "kv_bytes_per_token: must be an integer > 0"),
])
def test_errors_name_the_field(change, message):
    raw = {"name": "x", "kv_bytes_per_token": 1, "prefill": {"overhead_s": 0, "per_token_s": 0, "per_token_ctx_s": 0},
           "decode": {"per_token_s": 0, "per_token_ctx_s": 0},
           "concurrency": {"prefill_slowdown": [1], "decode_slowdown": [1]}, "measured": {}}
    raw.update(change)
    with pytest.raises(CostModelError, match=message):
        parse_cost_model(raw, source="x.json")


def test_shipped_models_load():
    for name in ("smollm2-135m", "qwen05b-shape"):
        assert load_cost_model(name).measured["how"]
