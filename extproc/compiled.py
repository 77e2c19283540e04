"""The routing core compiled by mypyc: the same typed Python, run as C extensions.

``make setup`` builds it (``scripts/build-core``) into ``extproc/_compiled/``, with a
manifest of every compiled source's SHA-256. At start-up (``extproc/__init__.py``) the compiled
modules are used only when every one still matches its source and this interpreter: after an
edit a stale build would run the old code, so the Python sources run instead, as they always
can. mypyc builds the modules as one group (calls between them are direct C calls), so it is
all of them or none.

``LLM_RING_CORE`` chooses: ``auto`` (the default: compiled when up to date), ``python`` (never:
``llm-ring bench decisions`` times both side by side), ``compiled`` (required: a missing or
stale build stops start-up, naming the first source that differs; CI sets it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from importlib.util import spec_from_file_location
from pathlib import Path

# The per-request path: the ring, the ledger, placement memory, the blocks and the prefix
# index, the replicas' learnt speeds (llm-aware asks each candidate's), the router and the two
# policies that bound loads, and flow control (its queue and orders), which every request passes
# when it is on. Policies and modules left out run as Python and call into these.
MODULES = (
    "extproc.routing.hashing",
    "extproc.routing.ring",
    "extproc.routing.ledger",
    "extproc.routing.lru",
    "extproc.routing.placement",
    "extproc.routing.blocks",
    "extproc.routing.prefix_index",
    "extproc.routing.speeds",
    "extproc.routing.router",
    "extproc.routing.policies.bounded_walk",
    "extproc.routing.policies.bounded",
    "extproc.routing.policies.llm_aware.where",
    "extproc.routing.policies.llm_aware.index",
    "extproc.routing.policies.llm_aware.view",
    "extproc.routing.policies.llm_aware.bounds",
    "extproc.routing.policies.llm_aware.guard",
    "extproc.routing.policies.llm_aware.warm",
    "extproc.routing.policies.llm_aware.prediction",
    "extproc.routing.policies.llm_aware.policy",
    "extproc.routing.orders.fifo",
    "extproc.routing.orders.least_attained",
    "extproc.routing.orders.round_robin",
    "extproc.routing.orders.vtc",
    "extproc.routing.orders.vtc_local",
    "extproc.routing.queue",
    "extproc.routing.flow_control",
)
GROUP = "llm_ring_core"  # mypyc's shared library: the module llm_ring_core__mypyc
ENV = "LLM_RING_CORE"
CHOICES = ("auto", "python", "compiled")
PACKAGE = Path(__file__).parent
BUILT = PACKAGE / "_compiled"
MANIFEST = BUILT / "manifest.json"


class CoreError(Exception):
    """LLM_RING_CORE=compiled but the compiled core cannot be used, or LLM_RING_CORE is unknown."""


def source(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def digests() -> dict[str, str]:
    return {module: hashlib.sha256(source(module).read_bytes()).hexdigest() for module in MODULES}


def stale() -> str | None:
    """Why the compiled core cannot be used (None: it can)."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return f"not built ({MANIFEST.relative_to(PACKAGE.parent)} missing or unreadable)"
    if manifest.get("cache_tag") != sys.implementation.cache_tag:
        return f"built for {manifest.get('cache_tag')}, running {sys.implementation.cache_tag}"
    built = manifest.get("sources", {})
    for module, digest in digests().items():
        if built.get(module) != digest:
            return f"{source(module).relative_to(PACKAGE.parent)} changed since it was built"
    missing = [name for name in (*MODULES, GROUP + "__mypyc") if _extension(name) is None]
    return f"{missing[0]} not built" if missing else None


class _CompiledCore(MetaPathFinder):
    """Finds the compiled modules (and their shared library) in BUILT before the sources."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name not in MODULES and name != GROUP + "__mypyc":
            return None
        file = _extension(name)
        return spec_from_file_location(name, file) if file is not None else None


def _extension(name: str) -> Path | None:
    base = BUILT.joinpath(*name.split("."))
    return next((path for suffix in EXTENSION_SUFFIXES if (path := base.with_name(base.name + suffix)).is_file()),
                None)


def install() -> str:
    """Use the compiled core when LLM_RING_CORE allows and it is up to date; returns "compiled"
    or "python" (how the core runs in this process)."""
    choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise CoreError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "python":
        return "python"
    why = stale()
    if why is not None:
        if choice == "compiled":
            raise CoreError(f"{ENV}=compiled but the compiled routing core is {why}: run 'make setup'")
        return "python"
    if not any(isinstance(finder, _CompiledCore) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompiledCore())
    return "compiled"


def describe(core: str) -> str:
    """How the routing core runs, in words: ``core`` as ``install`` returned it."""
    if core == "compiled":
        return f"compiled (mypyc, {len(MODULES)} modules)"
    if os.environ.get(ENV) == "python":
        return f"Python ({ENV}=python)"
    return f"Python (the compiled core is {stale()}: `make setup` builds it)"
