"""The local stack's store: the redis-server several gateways share (redis_server.py runs it)."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.stack.daemons import Daemon, daemon_of, spawn, wait_for
from extproc.stack.errors import Progress, StackError
from extproc.stack.gateways import STORE, store_url
from extproc.stack.ports import HOST, port_of
from extproc.stack.redis_server import (
    ADMIN,
    password_file,
    redis_answers,
    redis_command,
    redis_server_binary,
    write_config,
)
from extproc.stack.state import StackRun

if TYPE_CHECKING:
    from extproc.stack.state import StackState


def redis_binary(configured: str) -> str:
    found = shutil.which(configured) if configured else redis_server_binary()
    if found is None:
        raise StackError(f"[gateways] redis_server: {configured or 'redis-server'} not found; several gateways "
                         "share their state in a redis-server (Debian: apt-get install redis-server)")
    return found


def start_store(stack: StackRun, binary: str, port: int, progress: Progress) -> None:
    (Path(stack.state.run_dir) / STORE).mkdir(parents=True, exist_ok=True)
    stack.state.store_url, stack.state.store_binary = store_url(port), binary
    run_store(stack)
    progress(f"store (redis-server) on {stack.state.store_url}")


def restart_store(stack: StackRun, progress: Progress) -> None:
    with stack.locked():
        old = daemon_of(stack.state.store)
        if old is None or old.alive():
            raise StackError("the store is running (or this stack has none): kill it first")
        stack.state.held_down = [n for n in stack.state.held_down if n != STORE]
        run_store(stack)
    progress("store restarted")


def run_store(stack: StackRun) -> None:
    """Start the store's redis-server as the state says and wait until it answers."""
    store = spawn_store(stack.state)
    stack.state.store = asdict(store)
    stack.save()
    wait_for(store, lambda: store_answers(stack.state), 15.0, "the store (redis-server)")


def store_answers(state: StackState) -> bool:
    return redis_answers(port_of(state.store_url))


def spawn_store(state: StackState) -> Daemon:
    run = Path(state.run_dir)
    config = write_config(port_of(state.store_url), run / STORE)  # passwords generated once, kept
    command = redis_command(state.store_binary, config)
    return spawn(command, run / "logs" / f"{STORE}.log", die_with_parent=state.die_with_parent)


# what the gateways keep of conversations in the store (service/store_layout.py): placements,
# pending requests and the shared prefix index; their registrations and loads stay
CONVERSATION_KEYS = ("*:place:*", "*:pending:*", "*:index:*")


def forget_conversations(state: StackState) -> int:
    """Delete what the store holds of conversations (a reset between experiment runs, on emptied
    caches); returns how many keys went. As the stack's admin user: the routers' user may not scan."""
    import redis

    folder = Path(state.run_dir) / STORE
    client = redis.Redis(host=HOST, port=port_of(state.store_url), username=ADMIN,
                         password=password_file(folder, ADMIN).read_text().strip(), socket_timeout=5.0)
    with client:
        keys = [key for pattern in CONVERSATION_KEYS for key in client.scan_iter(match=pattern, count=1000)]
        if keys:
            client.delete(*keys)
        return len(keys)
