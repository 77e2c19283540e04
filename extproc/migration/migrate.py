"""A replica's conversations moved out before it stops: find, plan, save, restore, tell the routers.

The routers have been told the replica is leaving (extproc/routing/leaving.py): it gets no new
conversation, only follow-ups of the ones whose cache has not moved. Within `deadline`
(monotonic seconds, `migrate_while_draining`), pass after pass as its slots turn idle: each busy-free slot of the
leaving replica is saved into the shared slot folder, its text traced back to a conversation
the routers placed there (openings.py), the worth-moving ones planned (planner.py), each file
checked against the receiver's Identity and restored into an idle slot there (then checked
in that slot, llama.py `held`), and every router told (Admin `Migrated`). Whatever fails is a
miss: that conversation's next turn is computed again, as without migration.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from extproc.migration import slotfiles
from extproc.migration.llama import LlamaServer, Slot, SlotError
from extproc.migration.openings import Framing, opening_keys
from extproc.migration.planner import Candidate, Costs, Move, plan
from extproc.routing.ring import HashRing

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Limits:
    min_tokens: int
    max_bytes: int  # slot files one migration may write
    max_age_seconds: float  # slot files older than this are removed
    folder_bytes: int  # the slot folder's bound


@dataclass
class Outcome:
    replica: str
    slots: int = 0  # slots holding a conversation
    matched: int = 0  # traced back to a conversation
    attempted: int = 0
    moved: list[tuple[int, str, int]] = field(default_factory=list)  # (conversation key, receiver, tokens)
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    saved_slots: list[tuple[int, int]] = field(default_factory=list)  # (slot, its last task) as saved
    moved_at: list[float] = field(default_factory=list)  # each move's wall time, as `moved`

    def add(self, later: Outcome) -> None:
        """A second pass's outcome into this one."""
        for name in ("slots", "matched", "attempted", "failed", "bytes", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(later, name))
        self.moved += later.moved
        self.moved_at += later.moved_at
        self.problems += later.problems
        self.saved_slots += later.saved_slots

    def as_dict(self) -> dict[str, object]:
        return {"replica": self.replica, "slots": self.slots, "matched": self.matched, "attempted": self.attempted,
                "succeeded": len(self.moved), "failed": self.failed, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "problems": self.problems[:5],
                "moves": [[key, receiver, tokens] for key, receiver, tokens in self.moved],
                "moved_at": [_iso(at) for at in self.moved_at]}


class Transport(Protocol):
    def deliver(self, receiver: str, conversation_key: int) -> tuple[str, int] | None:
        """Make the conversation's slot file readable by `receiver`'s llama.cpp: (its file name
        there, its tokens), or None when that receiver may not load it (a miss)."""


@dataclass(frozen=True)
class SharedFolder:
    """Every replica saves and restores in one folder (the local stack)."""

    folder: Path
    identities: Mapping[str, slotfiles.Identity]

    def deliver(self, receiver: str, conversation_key: int) -> tuple[str, int] | None:
        identity = self.identities[receiver]
        manifest = slotfiles.restorable(self.folder, identity, conversation_key)
        return None if manifest is None else (f"{slotfiles.stem(identity, conversation_key)}.bin", manifest.tokens)


def migrate_out(leaving: tuple[str, str], staying: Mapping[str, str], routers: Sequence[str], folder: Path,
                identity: slotfiles.Identity, transport: Transport, costs: Costs, limits: Limits, deadline: float,
                progress: Progress = lambda _: None, done: frozenset[tuple[int, int]] = frozenset(),
                router_token: str | None = None, replica_key: str | None = None) -> Outcome:
    """Move what is worth moving from `leaving` (name, address) to `staying` ({name: address});
    folder: where the leaving replica saves (its --slot-save-path), identity: its identity;
    routers: the Admin addresses of every routing service (router_token: what their migration
    ports want, sent with every call); replica_key: the replicas' API key, sent with every call
    to a replica; done: (slot, last task) an earlier
    pass saved: a slot that ran a task since (its conversation came back) is saved again. A
    first pass moves the idle slots while the replica still serves (its routers then send those
    conversations to their receivers), a later one what changed since and what was busy."""
    name, address = leaving
    outcome = Outcome(name)
    began = time.monotonic()
    try:
        source = LlamaServer(address, key=replica_key)
        framing = Framing.learn(source.render)
        state, placed = _routers_placements(routers, router_token, name)
        candidates, saved = _saved_slots(source, name, folder, identity, framing, placed, outcome, done)
        ring = HashRing(staying, int(state["virtual_nodes"]), int(state["hash_seed"]))
        idle = _idle_on(staying, replica_key)
        moves = plan(candidates, ring, {r: len(s) for r, s in idle.items()}, costs, limits.min_tokens,
                     limits.max_bytes)
        if moves and time.monotonic() < deadline:
            delivered = _deliver(moves, transport, outcome)
            moves = [m for m in moves if m.conversation_key in delivered]
            receivers = {r: LlamaServer(staying[r], max(1.0, deadline - time.monotonic()), replica_key) for r in idle}
            restored = _restore_moves(moves, receivers, idle, delivered, saved, outcome)
            # the routers only once each copy is in place and checked: a next turn sent before
            # goes to the leaving replica, which still holds it (and the move is made again)
            if restored:
                _tell(routers, router_token, restored, outcome)
            outcome.moved += restored
            outcome.moved_at += [time.time()] * len(restored)
        elif moves:
            outcome.problems.append("deadline reached")
    except (SlotError, OSError, KeyError, ValueError) as exc:
        outcome.problems.append(str(exc))
    except Exception as exc:  # a router that does not answer (grpc.RpcError): a miss, the scale goes on
        outcome.problems.append(f"{type(exc).__name__}: {exc}")
    outcome.seconds = time.monotonic() - began
    _tell(routers, router_token, [], outcome)  # the counts, for the routers' metrics
    slotfiles.prune(folder, limits.folder_bytes, limits.max_age_seconds)
    progress(f"migration from {name}: {len(outcome.moved)} of {outcome.slots} slot(s) moved "
             f"({outcome.bytes:,} bytes, {outcome.seconds:.2f}s)"
             + (f"; {outcome.problems[0]}" if outcome.problems else ""))
    return outcome


def _routers_placements(routers: Sequence[str], router_token: str | None, name: str
                        ) -> tuple[dict[str, Any], dict[str, dict[int, int]]]:
    """The routing state (as the last router reports it: its ring's settings) and, by opening, the
    conversations the routers placed on ``name`` with their prompt tokens."""
    from extproc.service.admin_client import AdminClient

    placed: dict[str, dict[int, int]] = {}  # opening -> {conversation key: prompt tokens}
    for router in routers:
        with AdminClient(router, token=router_token) as admin:
            state = admin.state()["routing"]
            for key, opening, tokens in admin.placements(name):
                if opening:
                    placed.setdefault(opening, {})[key] = tokens
    return state, placed


def _idle_on(staying: Mapping[str, str], replica_key: str | None) -> dict[str, list[Slot]]:
    """Each staying replica's idle slots, asked all at once: a busy replica answers after its batch."""
    with ThreadPoolExecutor(max(1, len(staying))) as pool:
        servers = [LlamaServer(address, key=replica_key) for address in staying.values()]
        return dict(zip(staying, pool.map(_idle_slots, servers), strict=True))


def _deliver(moves: list[Move], transport: Transport, outcome: Outcome) -> dict[int, tuple[str, int]]:
    """Each move's file first where its receiver can read it (conversation key -> file): a receiver
    that may not load it (another model, context or KV type) is a miss that no router hears of."""
    with ThreadPoolExecutor(len(moves)) as pool:
        files = list(pool.map(lambda m: transport.deliver(m.receiver, m.conversation_key), moves))
    for move, file in zip(moves, files, strict=True):
        if file is None:
            outcome.attempted += 1
            outcome.failed += 1
            outcome.problems.append(f"{move.receiver}: no slot file of its identity (a miss)")
    return {m.conversation_key: file for m, file in zip(moves, files, strict=True) if file is not None}


def _restore_moves(moves: list[Move], receivers: Mapping[str, LlamaServer], idle: Mapping[str, list[Slot]],
                   delivered: dict[int, tuple[str, int]], saved: dict[int, tuple[int, list[int]]],
                   outcome: Outcome) -> list[tuple[int, str, int]]:
    """Restore the delivered moves on their receivers; (conversation key, receiver, tokens) of each
    that succeeded, counted in ``outcome`` with the failures."""
    results = _restore_all(moves, receivers, idle, delivered, {k: t for k, (_, t) in saved.items()})
    restored = []
    for move, problem in zip(moves, results, strict=True):
        outcome.attempted += 1
        if problem is None:
            restored.append((move.conversation_key, move.receiver, move.tokens))
            outcome.bytes += saved[move.conversation_key][0]
        else:
            outcome.failed += 1
            outcome.problems.append(problem)
    return restored


def _saved_slots(source: LlamaServer, name: str, folder: Path, identity: slotfiles.Identity, framing: Framing,
                 placed: dict[str, dict[int, int]], outcome: Outcome,
                 done: frozenset[tuple[int, int]]) -> tuple[list[Candidate], dict[int, tuple[int, list[int]]]]:
    """Save every slot that holds a conversation the routers placed here; (candidates, key -> its
    file's bytes and tokens)."""
    candidates, saved = [], {}
    for slot in source.slots():
        if slot.tokens == 0 or slot.processing or (slot.id, slot.last_task) in done:
            continue
        outcome.slots += 1
        outcome.saved_slots.append((slot.id, slot.last_task))
        scratch = f"{identity.tag}-out-{name}-{slot.id}.bin"
        written = int(source.save(slot.id, scratch)["n_written"])
        outcome.bytes += written
        tokens = slotfiles.read_tokens(folder / scratch)
        found = None if tokens is None else _conversation(source.detokenize(tokens), len(tokens), framing, placed)
        if tokens is None or found is None:
            outcome.problems.append(f"{name} slot {slot.id}: " + ("not a slot file it can read" if tokens is None else
                                    f"{len(tokens)} tokens, no conversation placed there opens as they do"))
            (folder / scratch).unlink(missing_ok=True)
            continue
        outcome.matched += 1
        stem = slotfiles.stem(identity, found)
        os.replace(folder / scratch, folder / f"{stem}.bin")
        slotfiles.write_manifest(folder, slotfiles.Manifest(identity, found, len(tokens), time.time(), name))
        candidates.append(Candidate(found, slot.id, len(tokens), slot.last_task))
        saved[found] = (written, tokens)
    return candidates, saved


def _conversation(text: str, tokens: int, framing: Framing, placed: dict[str, dict[int, int]]) -> int | None:
    """The conversation with the slot's opening (several share one: the one whose last prompt
    is nearest the slot's length); taken out of `placed`, so no two slots name the same one."""
    found = [(abs(prompt - tokens), key, opening) for opening in opening_keys(text, framing)
             for key, prompt in placed.get(opening, {}).items()]
    if not found:
        return None
    _, key, opening = min(found)
    del placed[opening][key]
    return key


def _idle_slots(server: LlamaServer) -> list[Slot]:
    """Slots a restore may take, empty ones first, then the least recently used."""
    return sorted((s for s in server.slots() if not s.processing), key=lambda s: (s.tokens > 0, s.last_task))


class Taken(str):
    """A restore that succeeded but its slot no longer holds it (another task ran there first)."""


def _restore_all(moves: Sequence[Move], receivers: Mapping[str, LlamaServer], idle: Mapping[str, list[Slot]],
                 files: Mapping[int, tuple[str, int]], tokens: Mapping[int, list[int]]) -> list[str | None]:
    """Every move restored at once, each into its own idle slot of its receiver; a move whose
    slot did not keep it (a request took the slot first) is tried once more, in an idle slot
    (read afresh) that no move of this pass used. Per move: None, or what went wrong (a miss)."""
    slots = {r: [s.id for s in free] for r, free in idle.items()}
    first = [slots[m.receiver].pop(0) for m in moves]
    with ThreadPoolExecutor(len(moves)) as pool:
        results = list(pool.map(lambda m, slot: _restore(m, receivers[m.receiver], slot, files[m.conversation_key],
                                                          tokens[m.conversation_key]), moves, first))
    # the slots this pass restored into, and those a request took
    used = {(m.receiver, slot) for m, slot, result in zip(moves, first, results, strict=True)
            if result is None or isinstance(result, Taken)}
    for i, (move, result) in enumerate(zip(moves, results, strict=True)):
        if not isinstance(result, Taken):
            continue
        server = receivers[move.receiver]
        try:
            other = next((s.id for s in _idle_slots(server) if (move.receiver, s.id) not in used), None)
        except SlotError as exc:
            results[i] = str(exc)
            continue
        if other is None:
            results[i] = f"{result}; no other idle slot"
            continue
        used.add((move.receiver, other))
        results[i] = _restore(move, server, other, files[move.conversation_key], tokens[move.conversation_key])
    return [None if r is None else str(r) for r in results]


def _restore(move: Move, server: LlamaServer, slot: int, file: tuple[str, int], tokens: list[int]) -> str | None:
    """The conversation's delivered file (its name on the receiver, its tokens) restored into
    `slot` of the receiver, then checked as its next turn would find it (`held`, not pinned to
    the slot); None, or what went wrong (a miss), a `Taken` when it was not found."""
    filename, count = file
    try:
        restored = server.restore(slot, filename)
        if int(restored.get("n_restored", 0)) != count:
            return f"{move.receiver}: restored {restored.get('n_restored')} of {count} tokens"
        ran_on, held = server.held(tokens)
    except SlotError as exc:
        return str(exc)
    # llama.cpp computes the last token again
    return None if held >= len(tokens) - 1 else Taken(f"{move.receiver} slot {slot}: {held} of {len(tokens)} "
                                                      f"tokens found after the restore (run on slot {ran_on})")


def migrate_while_draining(source: LlamaServer, deadline: float, migrate_pass: Callable[[frozenset[tuple[int, int]]],
                           Outcome], total: Outcome) -> Outcome:
    """Move a leaving replica's caches as its slots turn idle: the idle ones at once, each busy
    one as soon as its request ends (its conversation's next turn may come within seconds),
    until none is busy or the deadline. ``migrate_pass(saved)`` moves what is not in ``saved``
    ((slot, last task) pairs); ``total`` gathers the passes."""
    # a pass takes seconds on a loaded machine, and busy slots finish during it: whether
    # another pass is due is read from the slots themselves, not from which were busy before
    while time.monotonic() < deadline:
        try:
            slots = source.slots()
        except SlotError as exc:  # gone, or refusing us: nothing more to move
            total.problems.append(str(exc))
            break
        saved, problems = set(total.saved_slots), len(total.problems)
        if any(not s.processing and s.tokens > 0 and (s.id, s.last_task) not in saved for s in slots):
            total.add(migrate_pass(frozenset(saved)))
            # a pass that saved nothing: its slot turned busy meanwhile (a follow-up came back to
            # it: wait for its end), or the pass failed before saving (it would again: stop)
            if len(total.saved_slots) == len(saved) and len(total.problems) > problems:
                break
        elif any(s.processing for s in slots):
            time.sleep(0.05)
        else:
            break
    return total


def tell_drained(routers: Sequence[str], token: str | None, replica: str) -> list[str]:
    """Every router: ``replica``'s drain is over, no request goes there any more (it stops now);
    the problems met (a router that could not be told)."""
    told = Outcome(replica)  # no counts: each pass told its own
    _tell(routers, token, [], told, drained=replica)
    return told.problems


def _tell(routers: Sequence[str], token: str | None, moves: list[tuple[int, str, int]], outcome: Outcome,
          drained: str = "") -> None:
    """Every router: ``moves`` (where each conversation's next turn goes), or this pass's counts
    (told once, after its moves)."""
    from extproc.service.admin_client import AdminClient

    counts = (0, 0, 0, 0.0) if moves else (outcome.attempted, outcome.failed, outcome.bytes, outcome.seconds)
    for router in routers:
        try:
            with AdminClient(router, token=token) as admin:
                admin.migrated(moves, *counts, drained=drained)
        except Exception as exc:  # that router routes the next turns as without migration
            outcome.problems.append(f"router {router}: {type(exc).__name__}")


def _iso(wall: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")
