"""What a discovery source is, and the registry that names the sources.

A source is one module holding a ``PLUGIN = SourcePlugin(...)``: its settings section
``[discovery.<name>]`` (a pydantic model, validated where the settings are read: a missing or
bad key stops start-up naming it, ``discovery.kubernetes.namespace``) and its factory. It is
named by one ``register`` line at the end of this file (a test may register its own). The
registry holds module names, imported only when their section is read: the Kubernetes sources
bring the ``kubernetes`` client, which a router on a file or a static list never needs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from pydantic import BaseModel

from extproc.discovery import Discovery


class SharedKeys(Protocol):
    """What every source may read of the [discovery] keys they share (DiscoverySettings)."""

    @property
    def leaving_seconds(self) -> float: ...


class SourcePlugin(NamedTuple):
    name: str  # [discovery] source, and its section [discovery.<name>]
    settings: type[BaseModel]  # the section's keys (a Strict model: an unknown key is refused by name)
    factory: Callable[[Any, SharedKeys], Discovery]  # (its validated section, the shared [discovery] keys)


REGISTRY: dict[str, str] = {}  # source name -> the module holding its PLUGIN


def register(name: str, module: str) -> None:
    """Name a source (once), found as ``PLUGIN`` in ``module``."""
    if name in REGISTRY:
        raise ValueError(f"discovery source {name!r} is already registered")
    REGISTRY[name] = module


def unregister(name: str) -> None:
    """Forget a source registered by ``register`` (a test's own)."""
    del REGISTRY[name]


def plugin(name: str) -> SourcePlugin:
    """The registered source ``name``, its module imported now."""
    found: SourcePlugin = importlib.import_module(REGISTRY[name]).PLUGIN
    if found.name != name:
        raise ValueError(f"{REGISTRY[name]}.PLUGIN is named {found.name!r}, registered as {name!r}")
    return found


class ChosenSource(SharedKeys, Protocol):
    """The [discovery] settings as the factory reads them."""

    @property
    def source(self) -> str: ...

    @property
    def section(self) -> Any: ...


def make_discovery(settings: ChosenSource) -> Discovery:
    """The source named by ``discovery.source``, built from its section."""
    return plugin(settings.source).factory(settings.section, settings)


register("static", "extproc.discovery.static")
register("file", "extproc.discovery.file")
register("kubernetes", "extproc.discovery.kubernetes")
register("inference-pool", "extproc.discovery.inference_pool")
