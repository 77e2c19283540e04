"""Slot files: what llama.cpp's `POST /slots/N?action=save` writes, named and checked.

A slot file is only meaningful to a replica of the same model, per-slot context and KV cache
type: restored into another one llama.cpp either refuses it or, for a model of the same shape
but other weights, silently fills the slot with a cache that means nothing. So every file
``<stem>.bin`` has a sidecar ``<stem>.json`` (the Manifest) saying what wrote it, and a
restore goes ahead only when the receiver's Identity equals the manifest's: anything else
(no sidecar, another model, a torn file) is a miss, never an error.

The token list is read back from the file itself (llama.cpp's sequence-state format, version
4: magic "ggsq", version, then the slot's tokens), so the migrator can tell which conversation
a slot holds without asking the replica.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MAGIC = 0x67677371  # "ggsq", llama.cpp's LLAMA_STATE_SEQ_MAGIC
VERSIONS = frozenset({4})  # the sequence-state versions whose token layout is known here


@dataclass(frozen=True)
class Identity:
    """What a slot's cache depends on: the model's bytes, the slot's context, the KV type."""

    model_sha256: str
    slot_context: int
    cache_type: str  # llama.cpp's --cache-type-k/-v (f16 unless set)

    @property
    def tag(self) -> str:
        return f"{self.model_sha256[:16]}-{self.slot_context}-{self.cache_type}"


@dataclass(frozen=True)
class Manifest:
    identity: Identity
    conversation_key: int
    tokens: int
    saved_at: float  # wall clock
    source: str  # the replica that saved it


def stem(identity: Identity, conversation_key: int) -> str:
    """A file name no replica of another identity would look for."""
    return f"{identity.tag}-{conversation_key:016x}"


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = folder / f"{stem(manifest.identity, manifest.conversation_key)}.json"
    path.write_text(json.dumps(asdict(manifest), sort_keys=True) + "\n")
    return path


def read_manifest(path: Path) -> Manifest | None:
    """The sidecar, or None when it is missing or not one."""
    try:
        raw = json.loads(path.read_text())
        return Manifest(Identity(**raw["identity"]), int(raw["conversation_key"]), int(raw["tokens"]),
                        float(raw["saved_at"]), str(raw["source"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def restorable(folder: Path, receiver: Identity, conversation_key: int) -> Manifest | None:
    """The manifest of the slot file for this conversation when `receiver` may load it, else None."""
    name = stem(receiver, conversation_key)
    manifest = read_manifest(folder / f"{name}.json")
    if manifest is None or manifest.identity != receiver or not (folder / f"{name}.bin").is_file():
        return None
    tokens = read_tokens(folder / f"{name}.bin")
    return manifest if tokens is not None and len(tokens) == manifest.tokens else None


def read_tokens(path: Path) -> list[int] | None:
    """The slot's tokens from a sequence-state file; None when it is not one this code can read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(24)
            if len(head) < 24:
                return None
            magic, version, _words, _seq, _cells, count = struct.unpack("<IIIiII", head)
            if magic != MAGIC or version not in VERSIONS:
                return None
            body = handle.read(4 * count)
    except OSError:
        return None
    if len(body) != 4 * count:
        return None
    return list(struct.unpack(f"<{count}i", body))


def prune(folder: Path, max_bytes: int, max_age_seconds: float, now: float | None = None) -> list[Path]:
    """Remove slot files older than max_age_seconds, then the oldest until at most max_bytes
    remain; a file without its sidecar (a save cut short) goes too. Returns what was removed."""
    now = time.time() if now is None else now
    files = sorted((p for p in folder.glob("*.bin") if p.is_file()), key=lambda p: p.stat().st_mtime)
    removed: list[Path] = []
    kept: list[tuple[Path, int]] = []
    for path in files:
        sidecar = path.with_suffix(".json")
        if not sidecar.exists() or now - path.stat().st_mtime > max_age_seconds:
            removed.append(path)
        else:
            kept.append((path, path.stat().st_size))
    total = sum(size for _, size in kept)
    for path, size in kept:
        if total <= max_bytes:
            break
        removed.append(path)
        total -= size
    for path in removed:
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)
    for orphan in folder.glob("*.json"):  # a sidecar whose file is gone
        if not orphan.with_suffix(".bin").exists():
            orphan.unlink(missing_ok=True)
    return removed
