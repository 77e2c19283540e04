"""The local stack's state file, <run dir>/state.json: what `status`, `scale`, `down` and the
supervisor find the running stack by (pids, ports, URLs, settings), its lock, and ``StackRun``:
that state as the stack's rooms (fleet, router, envoy, store, supervisor) read and write it."""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from extproc.files import write_atomically
from extproc.stack.errors import StackError
from extproc.stack.gateways import GatewayState
from extproc.stack.replicas import Replica, ReplicaSettings, replica_index, replica_name

STATE_FILE = "state.json"


@dataclass(frozen=True)
class ServedModel:
    """A model the stack's replicas serve: its GGUF file, the name it is served under (requests'
    ``model``, GET /v1/models), what identifies its slot files, its KV cache's bytes a token."""

    path: str
    alias: str
    sha256: str
    kv_bytes_per_token: int  # read from the GGUF once, at up (it takes seconds)


@dataclass
class StackState:
    """What state.json holds."""

    run_dir: str
    gateway_url: str  # what clients use: the front with several gateways, else the gateway's Envoy
    envoy_admin: str  # the admin of the Envoy on that port
    policy: str
    model: str  # [replicas] model as given: one model, or the models the replicas serve in turn
    replica_settings: dict[str, Any]  # ReplicaSettings, the first replica's model in it
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
    # tokens a replica holds (ctx_size + cache-ram): each router's routing.replicas.cache_tokens
    prefix_capacity_tokens: int = 0
    supervisor: dict[str, Any] = field(default_factory=dict)
    restarts: dict[str, dict[str, float]] = field(default_factory=dict)  # process name -> supervisor.Restarts
    held_down: list[str] = field(default_factory=list)  # killed on purpose: the supervisor leaves them
    started_at: float = 0.0
    startup_seconds: float = 0.0
    migration: dict[str, Any] = field(default_factory=dict)  # MigrationSection ({}: a stack started without)
    models: list[dict[str, Any]] = field(default_factory=list)  # ServedModel: replica llm-i serves [i mod length]

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


class StackRun:
    """A running stack's state, read and written under the run dir's lock: what each room of
    the stack is given (``Stack`` adds the orchestration on top)."""

    def __init__(self, state: StackState) -> None:
        self.state = state

    @classmethod
    def find(cls, run: Path) -> Self:
        state = read_state(run)
        if state is None:
            raise StackError(f"no stack in {run} (start one with `llm-ring up`)")
        return cls(state)

    @contextlib.contextmanager
    def locked(self, wait: bool = True) -> Iterator[bool]:
        """Hold the run dir's lock (the supervisor and the commands that change the stack take
        turns) with the state re-read from state.json; yields False if not waiting and busy."""
        run = Path(self.state.run_dir)
        with run_dir_lock(run, wait) as held:
            if held:
                self.state = read_state(run) or self.state
            yield held

    def save(self) -> None:
        write_state(self.state)

    @property
    def replica_list(self) -> list[Replica]:
        return [Replica.from_dict(r) for r in self.state.replicas]

    @property
    def gateway_list(self) -> list[GatewayState]:
        return [GatewayState(**gw) for gw in self.state.gateways]

    def model_of(self, name: str) -> ServedModel:
        """The model replica ``name`` serves (llm-i: the i-th of the models, in turn)."""
        cycle = self.state.models
        return ServedModel(**cycle[replica_index(name) % len(cycle)])

    @property
    def router_mode(self) -> bool:
        """Every replica serves every model, loading them on demand (docs/fleets.md)."""
        return bool(self.state.replica_settings.get("models_dir"))

    def served_models(self) -> list[ServedModel]:
        """Each model of the fleet once, in the order of [replicas] model."""
        return [ServedModel(**entry) for entry in {entry["path"]: entry for entry in self.state.models}.values()]

    def replica_settings(self, name: str = replica_name(0)) -> ReplicaSettings:
        """How replica ``name`` runs: the settings every replica shares, with its model."""
        model = self.model_of(name)
        return replace(ReplicaSettings(**self.state.replica_settings), model=model.path, alias=model.alias)

    def gateway(self, name: str) -> GatewayState:
        found = next((gw for gw in self.gateway_list if gw.name == name), None)
        if found is None:
            raise StackError(f"no gateway {name!r}: this stack has {', '.join(g.name for g in self.gateway_list)}")
        return found

    def keep(self, gateway: GatewayState) -> None:
        """Record a changed gateway in the state (save() writes it)."""
        self.state.gateways = [asdict(gateway) if gw["name"] == gateway.name else gw for gw in self.state.gateways]
