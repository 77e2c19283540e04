import pytest

from extproc.policy_spec import ExperimentError, parse_policy


def test_policy_specs_with_knobs():
    assert parse_policy("llm-aware").routing == {"policy": "llm-aware"}
    spec = parse_policy("bounded:load_unit=tokens,epsilon=0.5")
    assert spec.routing == {"policy": "bounded", "load_unit": "tokens", "epsilon": 0.5}
    with pytest.raises(ExperimentError, match="unknown policy 'best'"):
        parse_policy("best")
    with pytest.raises(ExperimentError, match="unknown setting colour .valid: epsilon, load_unit, virtual_nodes"):
        parse_policy("bounded:colour=red")
    with pytest.raises(ExperimentError, match="'epsilon' is not <routing setting>=<value>"):
        parse_policy("bounded:epsilon")
