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
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from extproc.stack.errors import StackError

PR_SET_PDEATHSIG = 1


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


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def daemon_of(record: Mapping[str, Any]) -> Daemon | None:
    """The Daemon a state file records ({}: none started)."""
    return Daemon(**record) if record else None


def process_status(daemon: Daemon | None, ready: Callable[[], bool]) -> dict[str, Any]:
    if daemon is None:
        return {"alive": False}
    alive = daemon.alive()
    return {"pid": daemon.pid, "alive": alive, "ready": alive and ready(), "log": daemon.log}


def wait_for(daemon: Daemon, ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Until `ready()`; StackError with the end of its log if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if not daemon.alive():
            raise StackError(f"{what} exited during start-up; log {daemon.log}:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout:g}s; log {daemon.log}:\n{daemon.log_tail()}")
        time.sleep(0.05)


def wait_until(condition: Callable[[], bool], timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise StackError(failure)
        time.sleep(0.05)


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
