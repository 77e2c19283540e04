"""The local stack's replica set: start, list, scale, roll, reset (replicas.py runs each one).

The routing services learn the set from <run dir>/replicas.json (discovery source "file"),
which only this module writes, atomically. A replica that leaves is out of that list first,
then drains and hands its conversations' caches to the others ([migration] enabled), then stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.files import write_atomically
from extproc.stack import replicas
from extproc.stack.envoy import wait_envoy_knows
from extproc.stack.errors import Progress, StackError
from extproc.stack.ports import HOST, free_port
from extproc.stack.replicas import Replica
from extproc.stack.router import wait_router_forgets, wait_router_knows
from extproc.stack.state import StackRun

if TYPE_CHECKING:
    from extproc.migration.migrate import Outcome

REPLICA_LIST = "replicas.json"


def start_replicas(stack: StackRun, names: list[str], ports: list[int], progress: Progress,
                   port_wait: float = 0.0) -> None:
    state = stack.state
    run = Path(state.run_dir)
    started = [replica for name, port in zip(names, ports, strict=True)  # each with its model
               for replica in replicas.start({name: port}, stack.replica_settings(name), run,
                                             die_with_parent=state.die_with_parent, port_wait=port_wait)]
    state.replicas += [r.as_dict() for r in started]
    state.replica_ports.update({r.name: r.port for r in started})
    stack.save()  # recorded before waiting: `down` from another shell finds them
    try:
        replicas.wait_healthy(started, state.health_timeout, progress)
    except replicas.ReplicaError:
        state.replicas = [r for r in state.replicas if r["name"] not in names]
        stack.save()
        raise


def write_replica_list(stack: StackRun) -> None:
    listing = {r.name: r.address for r in stack.replica_list}
    write_atomically(Path(stack.state.run_dir) / REPLICA_LIST, json.dumps(listing, sort_keys=True) + "\n")


def scale(stack: StackRun, n: int, progress: Progress, drain_timeout: float,
          migrate: bool | None = None) -> list[dict[str, object]]:
    """Run n replicas: new ones join once healthy; removed ones leave the list, drain, hand
    their conversations' caches to the others ([migration] enabled, or `migrate`), stop.
    Returns each removed replica's step, as `roll` does (without "up")."""
    if n < 1:
        raise StackError(f"scale {n}: at least 1 replica")
    with stack.locked():
        current = stack.replica_list
        if n > len(current):
            _scale_out(stack, len(current), n, progress)
        elif n < len(current):
            return _scale_in(stack, current[:n], current[n:], progress, drain_seconds(stack, drain_timeout), migrate)
        stack.save()
        return []


def _scale_out(stack: StackRun, current: int, n: int, progress: Progress) -> None:
    names = [replicas.replica_name(i) for i in range(current, n)]
    ports = [stack.state.replica_ports.get(name) or _new_port(stack, i)
             for i, name in zip(range(current, n), names, strict=True)]
    progress(f"scaling {current} -> {n}: starting {', '.join(names)}")
    start_replicas(stack, names, ports, progress, port_wait=5.0)
    _bring_in(stack, set(names), {f"{HOST}:{port}" for port in ports})


def _scale_in(stack: StackRun, staying: list[Replica], leaving: list[Replica], progress: Progress,
              drain_timeout: float, migrate: bool | None) -> list[dict[str, object]]:
    progress(f"scaling {len(staying) + len(leaving)} -> {len(staying)}: removing "
             f"{', '.join(r.name for r in leaving)}")
    steps = _leave(stack, leaving, staying, progress, migrate, drain_timeout)
    stack.save()
    return steps


def roll(stack: StackRun, name: str, progress: Progress, migrate: bool | None = None) -> dict[str, object]:
    """Restart one replica as a rolling update does: out of the list, drain, migrate its
    caches ([migration] enabled, or `migrate`), stop, start on its port, healthy, back in the
    list. Returns {"replica", "out" (left the lists), "drained" (drained and migrated), "down"
    (stopped), "up" (back), ISO times, and "migration"}."""
    with stack.locked():
        current = stack.replica_list
        leaving = next((r for r in current if r.name == name), None)
        if leaving is None:
            raise StackError(f"no replica {name!r}")
        staying = [r for r in current if r.name != name]
        step = _leave(stack, [leaving], staying, progress, migrate, drain_seconds(stack, 60.0))[0]
        stack.state.replicas = [r.as_dict() for r in staying]
        start_replicas(stack, [name], [leaving.port], progress, port_wait=5.0)
        stack.state.replicas.sort(key=lambda r: replicas.replica_index(str(r["name"])))
        _bring_in(stack, {name}, {leaving.address})
        return {**step, "up": _iso(time.time())}


def _leave(stack: StackRun, leaving: list[Replica], staying: list[Replica], progress: Progress, migrate: bool | None,
           drain_timeout: float) -> list[dict[str, object]]:
    """Each of `leaving` leaves, drains and stops; per replica {"replica", "out" (began leaving),
    "drained", "down" (ISO times), "migration"}. With migration, in the order of
    extproc/routing/leaving.py: every routing service is told it is leaving (no new
    conversation goes there; its conversations' follow-ups still do until their caches have
    moved), its idle slots move at once, each busy one when its request ends; it leaves the
    lists once drained or at the deadline. Without, it leaves the lists first, then drains."""
    deadline = time.monotonic() + drain_timeout
    section = stack.state.migration
    moving = bool(section) and bool(staying) and bool(section.get("enabled") if migrate is None else migrate)
    if not moving:
        _take_out(stack, staying, {r.name for r in leaving})
        out = _iso(time.time())
        _drain(leaving, deadline - time.monotonic(), progress, replica_key(stack))
        steps = [{"replica": r.name, "out": out, "drained": _iso(time.time()), "migration": {}} for r in leaving]
    else:
        from extproc.migration.migrate import Outcome

        near = float(section.get("near_seconds", 15.0))
        for replica in leaving:
            _tell_leaving(stack, replica.name, deadline - time.monotonic(), near)
        out = _iso(time.time())
        steps = []
        for replica in leaving:
            receivers = _receivers(stack, replica, staying)
            if receivers:
                outcome = migrate_draining(stack, replica, receivers, deadline, progress, Outcome(replica.name))
            else:
                progress(f"{replica.name}: no staying replica of its model takes its caches; draining only")
                outcome = Outcome(replica.name).as_dict()
            steps.append({"replica": replica.name, "out": out, "drained": _iso(time.time()), "migration": outcome})
        _take_out(stack, staying, {r.name for r in leaving})
        # a follow-up routed there just before it left the lists (its cache not moved) finishes
        _drain(leaving, max(0.0, deadline - time.monotonic()), lambda _: None, replica_key(stack))
    replicas.stop_all(leaving)
    down = _iso(time.time())
    return [{**step, "down": down} for step in steps]


def _tell_leaving(stack: StackRun, name: str, seconds: float, near: float) -> None:
    """Every routing service: `name` is leaving (a router that does not answer treats it as
    in the list until it is dropped from it)."""
    from extproc.service.admin_client import AdminClient

    for gw in stack.gateway_list:
        try:
            with AdminClient(gw.router_address) as admin:
                admin.leaving(name, seconds, near)
        except Exception:  # noqa: BLE001 - that router routes as before: the replica is in its list until dropped
            continue


def _take_out(stack: StackRun, staying: list[Replica], leaving: set[str]) -> None:
    """Only `staying` in the replica list, once every routing service has dropped `leaving`."""
    stack.state.replicas = [r.as_dict() for r in staying]
    write_replica_list(stack)
    stack.save()
    for gw in stack.gateway_list:
        wait_router_forgets(leaving, gw.router_address)


def _bring_in(stack: StackRun, names: set[str], addresses: set[str]) -> None:
    """The started replicas into the list, until every routing service and Envoy knows them."""
    write_replica_list(stack)
    stack.save()
    for gw in stack.gateway_list:
        wait_router_knows(names, gw.router_address)
        wait_envoy_knows(addresses, gw.envoy_admin)


def drain_seconds(stack: StackRun, fallback: float) -> float:
    return float(stack.state.migration.get("drain_seconds", fallback))


def migrate_draining(stack: StackRun, leaving: Replica, receivers: list[Replica], deadline: float, progress: Progress,
                     early: Outcome) -> dict[str, object]:
    """Move `leaving`'s caches to `receivers` (the staying replicas of its model) as its slots
    turn idle (early: what was moved already), until none is busy or the deadline (migrate.py's
    migrate_while_draining)."""
    from extproc.migration.llama import LlamaServer
    from extproc.migration.migrate import migrate_while_draining

    source = LlamaServer(leaving.address, max(1.0, deadline - time.monotonic()), replica_key(stack))
    total = migrate_while_draining(
        source, deadline, lambda saved: _migrate(stack, leaving, receivers, deadline, lambda _: None, saved), early)
    problem = f"; {total.problems[0]}" if total.problems else ""
    progress(f"drained {leaving.name}; migration: {len(total.moved)} of {total.slots} slot(s) moved "
             f"({total.bytes:,} bytes, {total.seconds:.2f}s){problem}")
    return total.as_dict()


def _migrate(stack: StackRun, leaving: Replica, receivers: list[Replica], deadline: float, progress: Progress,
             done: frozenset[tuple[int, int]]) -> Outcome:
    """Move what is worth moving from `leaving` to `receivers` (the staying replicas of its model)."""
    from extproc.migration.migrate import Limits, SharedFolder, migrate_out
    from extproc.migration.planner import Costs
    from extproc.migration.slotfiles import Identity

    model = stack.model_of(leaving.name)
    section = stack.state.migration
    identity = Identity(model.sha256, stack.replica_settings(leaving.name).slot_context, "f16")
    costs = Costs(model.kv_bytes_per_token, section["prefill_ms_per_token"] / 1000,
                  section["transfer_mib_per_second"] * 2**20)
    limit = int(section["max_disk_mib"]) * 2**20
    limits = Limits(int(section["min_tokens"]), limit, float(section["max_age_seconds"]), limit)
    folder = replicas.slot_folder(Path(stack.state.run_dir))
    transport = SharedFolder(folder, {r.name: identity for r in receivers})
    outcome = migrate_out((leaving.name, leaving.address), {r.name: r.address for r in receivers},
                          [gw.router_address for gw in stack.gateway_list], folder, identity, transport, costs,
                          limits, deadline, progress, done, replica_key=replica_key(stack))
    return outcome


def _receivers(stack: StackRun, leaving: Replica, staying: list[Replica]) -> list[Replica]:
    """The staying replicas that can take `leaving`'s caches: those of its model (another model's
    cache is none); none in router mode, where a slot belongs to one of several models (docs/fleets.md)."""
    if stack.router_mode:
        return []
    model = stack.model_of(leaving.name).path
    return [r for r in staying if stack.model_of(r.name).path == model]


def reset_caches(stack: StackRun, progress: Progress) -> None:
    """Empty every replica's prompt caches.

    With a host-RAM prompt cache (cache_ram_mib > 0), erasing the slots is not enough
    (the RAM cache restores saved prefixes), so the replicas are restarted on their
    ports (the replica list does not change); without one, erasing the slots is a
    complete reset in milliseconds.
    """
    settings = stack.replica_settings()
    current = stack.replica_list
    if settings.cache_ram_mib == 0:
        for replica in current:
            replicas.erase_slots(replica.address, settings.parallel, replica_key(stack))
    else:
        progress(f"restarting {len(current)} replica(s) to empty their caches")
        replicas.stop_all(current)
        stack.state.replicas = []
        start_replicas(stack, [r.name for r in current], [r.port for r in current], progress, port_wait=5.0)
        stack.save()


def replica_key(stack: StackRun) -> str:
    """The key this stack's replicas want (replicas.api_key_file)."""
    return replicas.api_key(Path(stack.state.run_dir))


def _new_port(stack: StackRun, index: int) -> int:
    return stack.state.replica_base + index if stack.state.replica_base else free_port()


def _iso(wall: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")


def _drain(leaving: list[Replica], timeout: float, progress: Progress, key: str) -> None:
    """Wait until the leaving replicas finish what they were sent before they left the list."""
    deadline = time.monotonic() + timeout
    for replica in leaving:
        while _busy(replica.address, key) and time.monotonic() < deadline:
            time.sleep(0.1)
    progress(f"drained {', '.join(r.name for r in leaving)}")


def _busy(address: str, key: str) -> bool:
    """Whether a slot of the replica is processing a request (False when it does not answer)."""
    from extproc.migration.llama import LlamaServer, SlotError

    try:
        return any(slot.processing for slot in LlamaServer(address, 2.0, key).slots())
    except SlotError:
        return False
