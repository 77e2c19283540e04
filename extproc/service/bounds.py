"""Client-chosen strings (ids, model and adapter names) kept in state and logs: bounded."""

from __future__ import annotations

import xxhash

from extproc.routing import adapters

BOUNDED_CHARS = 64  # client-chosen ids kept in state and logs: longer ones are cut and hashed


def bounded(value: str, limit: int = BOUNDED_CHARS) -> str:
    """``value``, or its head and a hash of the whole when longer than ``limit``: a client's id
    can neither blow up a log line or the placement memory, nor collide by sharing a head."""
    if len(value) <= limit:
        return value
    return value[: limit - 17] + "~" + xxhash.xxh64_hexdigest(value.encode(errors="replace"))


def bounded_scope(model: str, lora: str) -> str:
    """A request's cache scope (adapters.scope) as the gateway keys it: each part ``bounded``."""
    return adapters.scope(bounded(model), bounded(lora))
