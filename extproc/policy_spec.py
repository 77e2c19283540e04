"""Which policies an experiment compares, as given on the command line: ``name`` or
``name:key=value,...`` ([routing] knobs, for ablations). Read alike by the live runner
(extproc.experiments.run) and the simulator (extproc.sim), so it stands below both."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

from extproc.cli_input import UsageError
from extproc.settings import PolicyName, RoutingSettings, toml_value

POLICIES = get_args(PolicyName)
KNOBS = tuple(name for name in RoutingSettings.model_fields if name != "policy")  # settable in a policy spec


class ExperimentError(UsageError):
    """Bad input for an experiment (policy, seeds, out-dir, gateway); the message says which."""


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """``name`` or ``name:key=value,key=value`` (routing knobs for ablations)."""

    label: str
    routing: dict[str, Any]


def parse_policy(spec: str) -> PolicySpec:
    name, _, knobs = spec.partition(":")
    if name not in POLICIES:
        raise ExperimentError(f"unknown policy {name!r} in {spec!r}; known: {', '.join(POLICIES)}")
    routing: dict[str, Any] = {"policy": name}
    for item in filter(None, knobs.split(",")):
        key, eq, text = item.partition("=")
        if not eq:
            raise ExperimentError(f"policy {spec!r}: {item!r} is not <routing setting>=<value>")
        if key not in KNOBS:
            raise ExperimentError(f"policy {spec!r}: unknown setting {key} (valid: {', '.join(KNOBS)})")
        routing[key] = toml_value(text)
    return PolicySpec(label=spec, routing=routing)
