"""Which policies an experiment compares, as given on the command line: ``name`` or
``name:key=value,...`` (the policy's parameters, [routing.<name>], or a shared [routing] key,
for ablations). Read alike by the live runner (extproc.experiments.run) and the simulator
(extproc.sim), so it stands below both."""

from __future__ import annotations

import dataclasses
from typing import Any

from extproc.cli_input import UsageError
from extproc.routing.policies.plugin import REGISTRY, param_names
from extproc.routing.settings import SHARED_KNOBS
from extproc.settings import toml_value

POLICIES = REGISTRY  # the registered names (a test's own policy among them once registered)


class ExperimentError(UsageError):
    """Bad input for an experiment (policy, seeds, out-dir, gateway); the message says which."""


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """``name`` or ``name:key=value,key=value`` (routing knobs for ablations)."""

    label: str
    routing: dict[str, Any]  # flat: "policy", then each knob (settings.with_knobs places them)


def knobs(policy: str) -> tuple[str, ...]:
    """What a spec of ``policy`` may set: its parameters, then the shared keys (the replicas'
    facts by their dotted names, ``replicas.slots``)."""
    return (*param_names(policy), *(key for key in SHARED_KNOBS if key != "policy"))


def parse_policy(spec: str) -> PolicySpec:
    name, _, given = spec.partition(":")
    if name not in POLICIES:
        raise ExperimentError(f"unknown policy {name!r} in {spec!r}; known: {', '.join(POLICIES)}")
    valid = knobs(name)
    routing: dict[str, Any] = {"policy": name}
    for item in filter(None, given.split(",")):
        key, eq, text = item.partition("=")
        if not eq:
            raise ExperimentError(f"policy {spec!r}: {item!r} is not <routing setting>=<value>")
        if key not in valid:
            raise ExperimentError(f"policy {spec!r}: unknown setting {key} (valid: {', '.join(valid)})")
        routing[key] = toml_value(text)
    return PolicySpec(label=spec, routing=routing)
