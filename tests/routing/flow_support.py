"""Flow settings for the flow-control tests (tests/routing, tests/service); a replica's slots
are the router's (routing.replicas.slots: tests/routing/conftest.py's routing(slots=N))."""

from __future__ import annotations

from typing import Any

from extproc.routing.flows import FlowSettings

FLOW: dict[str, Any] = {
    "enabled": True,
    "tenant_header": "x-gateway-inference-fairness-id",
    "objective_header": "x-gateway-inference-objective",
    "default_tenant": "default",
    "objectives": {"interactive": 10, "standard": 0, "batch": -10},
    "default_priority": 0,
    "anonymous_max_priority": 0,
    "reserved_slots": 0,
    "input_weight": 1.0,
    "output_weight": 2.0,
    "locality_deficit": 1000.0,
    "band_size": 100,
    "ttl_seconds": 10.0,
}


def flow_settings(**changes: Any) -> FlowSettings:
    return FlowSettings.model_validate({**FLOW, **changes})
