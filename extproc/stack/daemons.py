"""Processes of the local stack: started detached, found again from another shell, stopped whole.

Each process gets its own session (process group = its pid), so stopping it takes down
anything it spawned. It is recorded as (pid, start time): a pid alone could name an
unrelated process after a reuse. ``die_with_parent`` (tests, demo) makes the kernel kill
the child when its starter dies, so even a crashed test leaves no orphans; the kernel ties
that to the starting *thread*, so it is only applied from the main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1


class PortInUse(RuntimeError):
    def __init__(self, port: int, what: str) -> None:
        super().__init__(f"port {port} (for {what}) is already in use on 127.0.0.1: "
                         f"stop whatever listens there or choose another port")
        self.port = port


@dataclass(frozen=True)
class Daemon:
    """A started process, as recorded in the stack's state file."""

    pid: int
    started: float  # psutil create_time: identifies the process together with the pid
    log: str

    def alive(self) -> bool:
        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.started) > 1e-3:
                return False  # the pid now names another process
            if process.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            return False
        # a zombie main thread whose other threads still run (and hold its sockets) is not gone yet
        with contextlib.suppress(OSError):
            return len(os.listdir(f"/proc/{self.pid}/task")) > 1
        return False

    def rss_bytes(self) -> int:
        with contextlib.suppress(psutil.Error):
            return int(psutil.Process(self.pid).memory_info().rss)
        return 0

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])
        return ""


def spawn(command: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
          die_with_parent: bool = False) -> Daemon:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env), start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent and _main_thread() else None,
        )
    _REAPABLE[process.pid] = process
    return Daemon(process.pid, psutil.Process(process.pid).create_time(), str(log))


def stop(daemons: Sequence[Daemon], timeout: float = 5.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `timeout` seconds."""
    live = _signal_and_wait(daemons, signal.SIGTERM, timeout)
    for daemon in live:
        if daemon.alive():
            _signal_group(daemon.pid, signal.SIGKILL)
    for daemon in live:  # the group may hold children of its leader
        _signal_group(daemon.pid, signal.SIGKILL)
    _reap()


def kill(daemons: Sequence[Daemon], timeout: float = 5.0) -> None:
    """SIGKILL each process group at once (a crash drill); returns once they are gone."""
    _signal_and_wait(daemons, signal.SIGKILL, timeout)


def _signal_and_wait(daemons: Sequence[Daemon], sig: signal.Signals, timeout: float) -> list[Daemon]:
    """Signal the groups of those alive, wait up to `timeout` for them to go; returns them."""
    live = [d for d in daemons if d.alive()]
    for daemon in live:
        _signal_group(daemon.pid, sig)
    deadline = time.monotonic() + timeout
    while any(d.alive() for d in live) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    return live


def check_ports_free(ports: Mapping[int, str], wait: float = 0.0) -> None:
    """PortInUse naming the first port (and its purpose) that something listens on.

    Waits up to `wait` seconds for a port to free up (a restart on the same port).
    """
    deadline = time.monotonic() + wait
    for port, what in ports.items():
        while not _bindable(port):
            if time.monotonic() > deadline:
                raise PortInUse(port, what)
            time.sleep(0.1)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        # as servers do: connections of a stopped server in TIME_WAIT must not count
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel has free right now (for tests)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# Popen objects of children started by this process, so that stopped ones get reaped
# (no zombies while a test or the demo keeps running).
_REAPABLE: dict[int, subprocess.Popen[bytes]] = {}


def _reap() -> None:
    for pid, process in list(_REAPABLE.items()):
        if process.poll() is not None:
            del _REAPABLE[pid]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
