"""What a llama.cpp replica's work costs in seconds: the calibrated cost model.

A cost model is a JSON file (``extproc/sim/costmodels/<name>.json``, written by
``llm-ring calibrate``). Every field must be present; a missing or wrong one is
reported by its dotted name. Times are "solo" seconds: the time a request takes when
it is the only busy slot. With k busy slots on the shared CPU each request runs
``slowdown[k]`` times slower (separate tables for prefill and decode, since llama.cpp
batches decode steps of several slots far better than it batches prompt chunks).

    prefill(new, cached) = overhead_s + new * per_token_s + new * (cached + new / 2) * per_token_ctx_s
    decode(out, context) = out * (per_token_s + (context + out / 2) * per_token_ctx_s)

``new`` is at least 1: llama.cpp re-evaluates one token even on a full cache hit.

An optional ``server`` object describes a GPU server's memory (absent: a llama.cpp
replica with slots and a host-RAM cache, no context limit, as the calibrated CPU models):

- ``kv_cache``: ``"slots"`` (llama.cpp: each slot keeps its last prompt, see ``replica``) or
  ``"paged"`` (a paged-KV engine such as vLLM: one token pool shared by every running
  request, blocks shared across requests by prefix hash, LRU eviction; see ``paged``);
- ``context_tokens``: the longest prompt + output a request may have (above: answered 400);
- paged only: ``kv_capacity_tokens`` (the pool), ``block_tokens`` (allocation unit) and
  ``max_running`` (requests batched at once, vLLM's max_num_seqs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COSTMODELS_DIR = Path(__file__).parent / "costmodels"


class CostModelError(ValueError):
    """A cost-model file is missing or invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class Server:
    kv_cache: str  # "slots" | "paged"
    context_tokens: int
    kv_capacity_tokens: int = 0  # paged only
    block_tokens: int = 0
    max_running: int = 0


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    kv_bytes_per_token: int  # host-RAM prompt cache entry size per token (12 KiB for 0.5B shapes)
    prefill_overhead_s: float
    prefill_per_token_s: float
    prefill_per_token_ctx_s: float
    decode_per_token_s: float
    decode_per_token_ctx_s: float
    prefill_slowdown: tuple[float, ...]  # index k-1: slowdown with k busy slots
    decode_slowdown: tuple[float, ...]
    measured: dict[str, Any]  # how, where and when it was measured (free-form, kept for the record)
    server: Server | None = None  # None: llama.cpp slots + host-RAM cache, no context limit

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        return (
            self.prefill_overhead_s
            + new_tokens * self.prefill_per_token_s
            + new_tokens * (cached_tokens + new_tokens / 2) * self.prefill_per_token_ctx_s
        )

    def decode_s(self, output_tokens: int, context_tokens: int) -> float:
        return output_tokens * (
            self.decode_per_token_s + (context_tokens + output_tokens / 2) * self.decode_per_token_ctx_s
        )

    def slowdowns(self, slots: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(prefill, decode) slowdown tables indexed by busy-slot count 0..slots (index 0 unused)."""
        return (0.0, *_extend(self.prefill_slowdown, slots)), (0.0, *_extend(self.decode_slowdown, slots))


def _extend(table: tuple[float, ...], slots: int) -> tuple[float, ...]:
    """The table for 1..slots busy slots; beyond the measured ones, continue the last step linearly."""
    values = list(table[:slots])
    step = table[-1] - table[-2] if len(table) > 1 else 0.0
    while len(values) < slots:
        values.append(values[-1] + step)
    return tuple(values)


def available_cost_models() -> list[str]:
    return sorted(p.stem for p in COSTMODELS_DIR.glob("*.json"))


def load_cost_model(name_or_path: str | Path) -> CostModel:
    """Read a cost model by name (``qwen05b-shape``) or by path to a JSON file."""
    text = str(name_or_path)
    path = Path(text) if text.endswith(".json") or "/" in text else COSTMODELS_DIR / f"{text}.json"
    if not path.is_file():
        known = ", ".join(available_cost_models())
        raise CostModelError(f"cost model not found: {text} (known: {known}; or give a path to a .json file)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CostModelError(f"cost model {path}: not valid JSON: {exc}") from None
    return parse_cost_model(raw, source=str(path))


class _Fields:
    """The cost model's fields read from ``raw``, each checked: a missing or wrong one is a
    CostModelError naming it."""

    def __init__(self, raw: Any, source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, *keys: str) -> Any:
        node = self.raw
        for depth, key in enumerate(keys):
            if not isinstance(node, dict) or key not in node:
                raise CostModelError(f"{self.source}: {'.'.join(keys[: depth + 1])}: missing")
            node = node[key]
        return node

    def number(self, *keys: str) -> float:
        value = self.get(*keys)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise CostModelError(f"{self.source}: {'.'.join(keys)}: must be a number >= 0 (got {value!r})")
        return float(value)

    def table(self, *keys: str) -> tuple[float, ...]:
        value = self.get(*keys)
        ok = isinstance(value, list) and value and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 1 for v in value
        )
        if not ok:
            raise CostModelError(f"{self.source}: {'.'.join(keys)}: must be a non-empty list of numbers >= 1 "
                                 f"(slowdown with 1, 2, ... busy slots; got {value!r})")
        return tuple(float(v) for v in value)

    def integer(self, *keys: str) -> int:
        value = self.get(*keys)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostModelError(f"{self.source}: {'.'.join(keys)}: must be an integer >= 1 (got {value!r})")
        return value


def parse_cost_model(raw: Any, source: str = "cost model") -> CostModel:
    fields = _Fields(raw, source)
    get, number, table = fields.get, fields.number, fields.table
    server = _server(fields) if isinstance(raw, dict) and "server" in raw else None
    measured = get("measured")
    if not isinstance(measured, dict):
        raise CostModelError(f"{source}: measured: must be an object describing the measurement")
    kv = get("kv_bytes_per_token")
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
        raise CostModelError(f"{source}: kv_bytes_per_token: must be an integer > 0 (got {kv!r})")
    return CostModel(
        name=str(get("name")),
        kv_bytes_per_token=kv,
        prefill_overhead_s=number("prefill", "overhead_s"),
        prefill_per_token_s=number("prefill", "per_token_s"),
        prefill_per_token_ctx_s=number("prefill", "per_token_ctx_s"),
        decode_per_token_s=number("decode", "per_token_s"),
        decode_per_token_ctx_s=number("decode", "per_token_ctx_s"),
        prefill_slowdown=table("concurrency", "prefill_slowdown"),
        decode_slowdown=table("concurrency", "decode_slowdown"),
        measured=measured,
        server=server,
    )


def _server(fields: _Fields) -> Server:
    """The server section: how the replica keeps its KV cache."""
    source, integer = fields.source, fields.integer
    kind = fields.get("server", "kv_cache")
    if kind == "slots":
        return Server("slots", integer("server", "context_tokens"))
    if kind != "paged":
        raise CostModelError(f"{source}: server.kv_cache: must be \"slots\" or \"paged\" (got {kind!r})")
    server = Server("paged", integer("server", "context_tokens"), integer("server", "kv_capacity_tokens"),
                    integer("server", "block_tokens"), integer("server", "max_running"))
    # the longest request, its 512-token blocks and its private tail each rounded up to block_tokens
    longest = server.context_tokens + (-(-server.context_tokens // 512) + 1) * server.block_tokens
    if longest > server.kv_capacity_tokens:
        raise CostModelError(f"{source}: server.kv_capacity_tokens: must hold the longest request "
                             f"(context_tokens {server.context_tokens} + block rounding = {longest} tokens; "
                             f"got {server.kv_capacity_tokens})")
    return server
