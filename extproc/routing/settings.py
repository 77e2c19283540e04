"""The [routing] settings: the policy, the keys every policy shares, the replicas' description
``[routing.replicas]`` (replica_facts.py), and each policy's own section ``[routing.<name>]``
validated by the registry (extproc/routing/policies/plugin.py).

The service's other sections, the file and the environment overrides are in extproc/settings.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from extproc.routing.policies import plugin
from extproc.routing.replica_facts import ReplicaFacts
from extproc.strict import Strict, validated_sections


class RoutingSettings(Strict):
    """The policy, the keys every policy shares, and each policy's own section ``[routing.<name>]``
    (its typed parameters, extproc/routing/policies/plugin.py): the one of ``policy`` must be
    given, any other given is checked too (Admin.SetRouting may switch to it)."""

    policy: str = Field(description="the routing policy: a registered name (extproc/routing/policies)")
    virtual_nodes: int = Field(gt=0, le=10_000, description="ring points per replica")
    hash_seed: int = Field(ge=0, lt=2**64, description="seed of the xxhash64 ring hash")
    memory_capacity: int = Field(ge=2, description="conversations remembered (least recently used forgotten)")
    # each replica's learnt speed (llm-aware's predicted time to first token reads it)
    speed_learning: bool = Field(description="learn each replica's speed from its answers' timings (false: the prior)")
    speed_ewma_weight: float = Field(gt=0, le=1, description="weight of the newest answer in a replica's speed")
    prior_prefill_tokens_per_s: float = Field(gt=0, description="a replica's prefill speed before any answer")
    prior_decode_tokens_per_s: float = Field(gt=0, description="a replica's decode speed before any answer")
    prior_request_overhead_ms: float = Field(ge=0, description="a request's fixed prefill cost before any answer")
    prior_model_load_ms: float = Field(ge=0, description="router mode: a model's load before one is seen "
                                                         "(docs/fleets.md)")
    prior_model_wake_ms: float = Field(ge=0, description="a sleeping model's wake before one is seen")
    replicas: ReplicaFacts = Field(description="what every replica is (read through the Router)")
    params: dict[str, Any] = Field(description="policy name -> its validated section (built from the sections)")

    @model_validator(mode="before")
    @classmethod
    def _policy_sections(cls, raw: Any) -> Any:
        """Each section named by a registered policy becomes its typed parameters under ``params``."""
        if not isinstance(raw, Mapping) or "params" in raw:
            return raw
        shared = {key: value for key, value in raw.items() if key not in plugin.REGISTRY}
        chosen = raw.get("policy")
        if not isinstance(chosen, str) or chosen not in plugin.REGISTRY:
            raise ValueError(f"unknown policy {chosen!r} (registered: {', '.join(plugin.REGISTRY)})")
        params = validated_sections(raw, plugin.REGISTRY, chosen, plugin.validate_params, "RoutingSettings")
        return {**shared, "params": params}

    def knobs(self) -> dict[str, Any]:
        """The shared keys, the replicas' facts (``replicas.slots``) and the chosen policy's
        parameters, in one flat mapping (the Admin API's view)."""
        facts = {f"replicas.{key}": value for key, value in self.replicas.model_dump().items()}
        return {**self.model_dump(exclude={"params", "replicas"}), **facts, **self.params[self.policy]._asdict()}

    def table(self) -> dict[str, Any]:
        """As the settings file's [routing] table: the shared keys and a section per policy given."""
        sections = {name: params._asdict() for name, params in self.params.items()}
        return {**self.model_dump(exclude={"params"}), **sections}


SHARED_ROUTING_KEYS = tuple(key for key in RoutingSettings.model_fields if key != "params")
# the knobs that set the shared keys: the replicas' facts by their dotted names
SHARED_KNOBS = (*(key for key in SHARED_ROUTING_KEYS if key != "replicas"),
                *(f"replicas.{key}" for key in ReplicaFacts.model_fields))
# keys an older settings file holds, refused naming where each one is (extproc/settings.py)
MOVED_KEYS = {"routing.replica_slots": "routing.replicas.slots",
              "routing.llm-aware.prefix_capacity_tokens": "routing.replicas.cache_tokens"}


def with_knobs(table: Mapping[str, Any], knobs: Mapping[str, Any]) -> dict[str, Any]:
    """A [routing] table with flat ``knobs`` set (``policy`` among them, or not): a shared key in
    [routing], a dotted one (``replicas.slots``) in its section, any other in the chosen policy's
    section, where a key it does not have is refused; a moved key stays where it was, so that its
    refusal names the new place."""
    out = {key: dict(value) if isinstance(value, Mapping) else value for key, value in table.items()}
    policy = knobs.get("policy", out.get("policy"))
    for key, value in knobs.items():
        section, dotted, name = key.partition(".")
        if dotted:
            out.setdefault(section, {})[name] = value
        elif key in SHARED_ROUTING_KEYS or f"routing.{key}" in MOVED_KEYS:
            out[key] = value
        else:
            out.setdefault(str(policy), {})[key] = value
    return out
