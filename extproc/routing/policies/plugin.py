"""What a policy is, and the registry that names the policies.

A policy is one file: its parameters, its reason codes and its factory,
gathered in one ``PolicyPlugin``, and one ``register`` line (policies/__init__.py; a test
may register its own). Its parameters are a NamedTuple whose fields carry their pydantic
constraints (``Annotated[float, Field(gt=0)]``): the settings section ``[routing.<name>]``,
validated where the settings are read (extproc/routing/settings.py), so a missing or bad key stops
start-up naming it (``routing.llm-aware.ttft_margin``). The parameters are written in
NamedTuple's functional form: mypyc, which compiles bounded and llm-aware, drops the
constraints of a class's annotations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from pydantic import TypeAdapter

from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.policies.situation import Situation
from extproc.routing.prefix_index import IndexChange
from extproc.routing.replica_facts import ReplicaFacts


class RoutingKeys(Protocol):
    """What the registry reads of the [routing] settings (RoutingSettings, which validates its
    sections against this registry, so it is named here only by what it offers)."""

    @property
    def policy(self) -> str: ...

    @property
    def params(self) -> Mapping[str, Any]: ...

    @property
    def hash_seed(self) -> int: ...


class Policy(Protocol):
    """A policy. Its view of the caches (SentView, SharedView, CacheMoves, CacheReports) is the
    policy itself, or a part it composes as ``view`` (the Router feeds whichever has the hooks)."""

    name: ClassVar[str]  # its registry name

    @property
    def prefix_block_chars(self) -> int:
        """> 0: requests must carry prefix_blocks of blocks this long (hashed only then)."""
        ...

    def decide(self, situation: Situation) -> Decision | None:
        """Pick a replica (None when none is eligible). Must not change the ledger."""
        ...


@runtime_checkable
class SentView(Protocol):
    """A policy that keeps its own view of what it sent where; the Router feeds it."""

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """``decision`` was charged: the request is on its way to ``decision.replica``."""

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        """The request is over: served (``ok``), failed or abandoned."""

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        """The fleet is now exactly ``replicas``."""


@runtime_checkable
class SharedView(Protocol):
    """A view of the caches several routers keep alike (through a store): each router keeps its
    changes for the others, and makes theirs, in their order."""

    def share_changes(self, on: bool) -> None:
        """From now on (``on``) this router's changes are kept until ``changes`` takes them."""

    def changes(self) -> list[IndexChange]:
        """This router's changes since the last call, oldest first."""
        ...

    def apply_changes(self, changes: Iterable[IndexChange]) -> None:
        """Another router's changes, in its order."""


@runtime_checkable
class CacheMoves(Protocol):
    """A policy that keeps its own view of where prompts are cached, told of a migration."""

    def moved(self, blocks: tuple[int, ...], tokens: int, source: str | None, receiver: str) -> None:
        """The cache of a prompt of ``blocks`` (``tokens``) went from ``source`` (None: unknown)
        to ``receiver``."""


@runtime_checkable
class CacheReports(Protocol):
    """A policy that learns from the cached tokens the replicas report (timings.cache_n)."""

    def reported(self, request: RouteRequest, replica: str, predicted: int, cached: int) -> None:
        """``replica`` served ``request`` with ``cached`` prompt tokens from its cache; the
        decision predicted ``predicted``."""


class PolicyPlugin(NamedTuple):
    name: str  # [routing] policy, and its section [routing.<name>]
    params: type[tuple[Any, ...]]  # a NamedTuple of Annotated fields: the section's keys
    # (its validated params, the shared [routing] keys, what every replica is: the Router's facts)
    factory: Callable[[Any, RoutingKeys, ReplicaFacts], Policy]
    reasons: Mapping[str, str]  # reason code -> meaning, every code its decisions give


NoParams = NamedTuple("NoParams", [])  # a policy without a section of its own
REGISTRY: dict[str, PolicyPlugin] = {}
_ADAPTERS: dict[str, TypeAdapter[Any]] = {}


def register(plugin: PolicyPlugin) -> PolicyPlugin:
    """Name a policy (once). Its parameters' schema is built now: a field without a type fails here."""
    if plugin.name in REGISTRY:
        raise ValueError(f"policy {plugin.name!r} is already registered")
    if not plugin.reasons:
        raise ValueError(f"policy {plugin.name!r}: no reason codes")
    _ADAPTERS[plugin.name] = TypeAdapter(plugin.params)
    REGISTRY[plugin.name] = plugin
    return plugin


def unregister(name: str) -> None:
    """Forget a policy registered by ``register`` (a test's own)."""
    del REGISTRY[name]
    del _ADAPTERS[name]


def param_names(policy: str) -> tuple[str, ...]:
    """The keys of ``[routing.<policy>]``."""
    return tuple(REGISTRY[policy].params._fields)  # type: ignore[attr-defined]


def validate_params(policy: str, section: Any) -> tuple[Any, ...]:
    """``[routing.<policy>]`` as the policy's typed parameters (pydantic.ValidationError: which key, why)."""
    params: tuple[Any, ...] = _ADAPTERS[policy].validate_python(section)
    return params


def reasons() -> dict[str, str]:
    """Every registered policy's reason codes (a code shared by several: its first meaning)."""
    merged: dict[str, str] = {}
    for plugin in REGISTRY.values():
        for code, meaning in plugin.reasons.items():
            merged.setdefault(code, meaning)
    return merged


def make_policy(settings: RoutingKeys, facts: ReplicaFacts) -> Policy:
    """The chosen policy, built for replicas that are as ``facts`` says."""
    plugin = REGISTRY[settings.policy]
    return plugin.factory(settings.params[settings.policy], settings, facts)
