"""A private redis-server (Debian's package; `make setup` installs it) for tests, benchmarks
and the local stack's gateways: on 127.0.0.1 only, nothing written to disk, bounded memory,
its log in the caller's directory. Never the machine's system-wide service.

Credentials: the ``default`` user is off; the routers connect as ``llm-ring`` (USER), allowed
only the commands the store modules (service/store*.py) send on keys ``<key_prefix>:*``
(``router_rule``, which k8s/35-store.yaml repeats: a test checks they agree), no script nor
function; ``admin`` may do anything (inspection, drills). Both passwords are generated into
0600 files in the server's folder (reused when it restarts there) and written into its 0600
config file, so no password is on a command line. Eviction: ``volatile-ttl``, the key nearest its expiry first:
every key the routers write has a TTL, so a write is never refused for memory, and one-shot
placements (short TTL) go before returning conversations (docs/several-gateways.md)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from extproc.files import private_secret, write_private
from extproc.stack.ports import HOST
from extproc.stack.processes import Running, StartError, accepts, free_port, spawn_child, wait_until_ready

MAX_MEMORY = "256mb"
USER = "llm-ring"
ADMIN = "admin"
# every command the store modules (service/store*.py) send, and no other: no EVAL, EVALSHA, SCRIPT,
# FCALL nor FUNCTION (a script's memory escapes maxmemory and a long one blocks the store: BUSY);
# MULTI/EXEC and WATCH make its reads one instant and its check-and-set exact
ROUTER_COMMANDS = (
    "get", "set", "del", "exists", "hgetall", "hset", "hsetnx", "hdel", "pexpire", "sadd", "srem", "srandmember",
    "zadd", "zrange", "zremrangebyrank", "xadd", "xread", "multi", "exec", "watch", "unwatch",
)  # fmt: skip


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")


def password_file(folder: Path, user: str = USER) -> Path:
    return folder / f"{user}.password"


def user_url(address: str) -> str:
    """The routers' store.url for a server at host:port (the password: store.password_file)."""
    return f"redis://{USER}@{address}/0"


def router_rule(key_prefix: str) -> str:
    """The routers' ACL rules after ``user llm-ring on >password``: their keys, no channel, their
    commands alone."""
    return f"resetkeys ~{key_prefix}:* resetchannels -@all " + " ".join(f"+{command}" for command in ROUTER_COMMANDS)


def write_config(port: int, folder: Path, key_prefix: str = "llm-ring", max_memory: str = MAX_MEMORY) -> Path:
    """The server's 0600 config file in ``folder`` (passwords generated once, beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    passwords = {user: private_secret(password_file(folder, user)) for user in (USER, ADMIN)}
    lines = [
        f"port {port}", f"bind {HOST}", "protected-mode yes", f"dir {folder}", 'save ""', "appendonly no",
        f"maxmemory {max_memory}", "maxmemory-policy volatile-ttl", "daemonize no",
        "user default off",
        f"user {USER} on >{passwords[USER]} {router_rule(key_prefix)}",
        f"user {ADMIN} on >{passwords[ADMIN]} ~* &* +@all",
    ]  # fmt: skip
    config = folder / "redis.conf"
    write_private(config, "\n".join(lines) + "\n")
    return config


def redis_command(binary: str, config: Path) -> list[str]:
    """The server's command line: every option, the passwords among them, in its config file.
    The shared state is rebuilt by the routers (no snapshots, no append-only file; a restart
    starts empty)."""
    return [binary, str(config)]


def start_redis(workdir: Path, port: int | None = None, max_memory: str = MAX_MEMORY) -> Running:
    """redis-server on 127.0.0.1:``port`` (a free one by default), a child process that
    ``Running.stop`` ends; ``address`` is host:port; the routers' password is in
    ``password_file(workdir)``, the admin's in ``password_file(workdir, ADMIN)``."""
    binary = redis_server_binary()
    if binary is None:
        raise StartError("no redis-server: `make setup` installs Debian's package (apt-get install redis-server)")
    port = port or free_port()
    config = write_config(port, workdir, max_memory=max_memory)
    running = spawn_child("redis-server", redis_command(binary, config), workdir / f"redis-{port}.log")
    wait_until_ready(running, lambda: accepts(port), 10.0)
    running.address = f"{HOST}:{port}"
    return running


def redis_answers(port: int, timeout: float = 1.0) -> bool:
    """The server on `port` answers (PING: +PONG, or -NOAUTH from a server that wants a password)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
