"""The local stack's state file, <run dir>/state.json: what `status`, `scale`, `down` and the
supervisor find the running stack by (pids, ports, URLs, settings), and its lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extproc.files import write_atomically
from extproc.stack.errors import StackError

STATE_FILE = "state.json"


@dataclass
class StackState:
    """What state.json holds."""

    run_dir: str
    gateway_url: str  # what clients use: the front with several gateways, else the gateway's Envoy
    envoy_admin: str  # the admin of the Envoy on that port
    policy: str
    model: str
    replica_settings: dict[str, Any]
    replica_ports: dict[str, int]  # name -> port, for every replica ever started (scale reuses them)
    replica_base: int
    health_timeout: float
    die_with_parent: bool
    replicas: list[dict[str, Any]] = field(default_factory=list)
    gateways: list[dict[str, Any]] = field(default_factory=list)  # GatewayState
    front: dict[str, Any] = field(default_factory=dict)  # several gateways: the front Envoy
    store: dict[str, Any] = field(default_factory=dict)  # several gateways: the redis-server
    store_url: str = ""  # its URL, as written into each routing service's [store] url
    store_binary: str = ""
    prefix_capacity_tokens: int = 0  # tokens a replica holds (ctx_size + cache-ram), written into each router
    supervisor: dict[str, Any] = field(default_factory=dict)
    restarts: dict[str, dict[str, float]] = field(default_factory=dict)  # process name -> supervisor.Restarts
    held_down: list[str] = field(default_factory=list)  # killed on purpose: the supervisor leaves them
    started_at: float = 0.0
    startup_seconds: float = 0.0
    migration: dict[str, Any] = field(default_factory=dict)  # MigrationSection ({}: a stack started without)
    model_sha256: str = ""
    kv_bytes_per_token: int = 0  # of the model (reading it from the GGUF takes seconds: once, at up)

    @property
    def router_address(self) -> str:
        """The first gateway's routing service (the only one with one gateway)."""
        return str(self.gateways[0]["router_address"])

    @property
    def metrics_url(self) -> str:
        return str(self.gateways[0]["metrics_url"])


def read_state(run: Path) -> StackState | None:
    path = run / STATE_FILE
    if not path.exists():
        return None
    try:
        return StackState(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:  # e.g. written by an llm-ring before --gateways
        raise StackError(f"{path} is not a state file of this llm-ring ({exc}); stop that stack's processes "
                         f"by hand and remove the file") from None


def write_state(state: StackState) -> None:
    write_atomically(Path(state.run_dir) / STATE_FILE, json.dumps(asdict(state), indent=2) + "\n")


def remove_state(run: Path) -> None:
    (run / STATE_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def run_dir_lock(run: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the run dir's lock (the supervisor and the commands that change the stack take
    turns); yields False if not waiting and busy."""
    with open(run / "state.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
