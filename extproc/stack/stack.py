"""The local stack: llama.cpp replicas + the routing service + Envoy, as detached processes.

Start order: replicas (until /health answers) -> replica list file -> [several gateways: the
store's redis-server] -> per gateway `llm-ring serve` (until gRPC health) and Envoy (until
its admin /ready) -> [several gateways: the front Envoy] -> the supervisor (supervisor.py),
which restarts any of them that dies, with backoff, and counts it in the state file. Everything the other commands need
(pids, ports, URLs, settings) is kept in <run dir>/state.json, so `status`, `scale` and
`down` work from any shell. The routing service learns the replica set from
<run dir>/replicas.json (discovery source "file"), which only this module writes, atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from extproc.files import write_atomically
from extproc.settings import Strict
from extproc.stack import models, replicas
from extproc.stack.daemons import Daemon, check_ports_free, free_ports, http_ok, kill, spawn, stop
from extproc.stack.gateways import (
    FRONT,
    PORTS_PER_GATEWAY,
    STORE,
    GatewayState,
    layout,
    port_purposes,
)
from extproc.stack.processes import ROUTER_REFERENCE, envoy_binary, grpc_serving, socket_name
from extproc.stack.redis_server import (
    password_file,
    redis_answers,
    redis_command,
    redis_server_binary,
    write_config,
)
from extproc.stack.replicas import HOST, Replica, ReplicaSettings

if TYPE_CHECKING:
    from extproc.migration.migrate import Outcome

REFERENCE_SETTINGS = Path(__file__).with_name("stack.toml")
RUN_ENV = "LLM_RING_RUN"
Progress = Callable[[str], None]


class StackError(RuntimeError):
    """The stack cannot do what was asked; the message says what and how to fix it."""


# ---- settings (stack.toml) -------------------------------------------------------------

class ReplicasSection(Strict):
    count: int = Field(ge=1, le=64)
    backend: replicas.Backend
    llama_server: str
    model: str = Field(min_length=1)
    ctx_size: int = Field(gt=0)
    parallel: int = Field(gt=0)
    threads: int = Field(gt=0)
    cache_ram_mib: int = Field(ge=0)
    health_timeout_seconds: float = Field(gt=0)


class PortsSection(Strict):
    """0 = any free port (tests)."""

    gateway: int = Field(ge=0, lt=65536)
    envoy_admin: int = Field(ge=0, lt=65536)
    router: int = Field(ge=0, lt=65536)
    metrics: int = Field(ge=0, lt=65536)
    replica_base: int = Field(ge=0, lt=65536)
    gateway_base: int = Field(ge=0, lt=65536)
    store: int = Field(ge=0, lt=65536)


class GatewaysSection(Strict):
    count: int = Field(ge=1, le=16)
    redis_server: str


class RouterSection(Strict):
    policy: str
    settings: str


class CheckSection(Strict):
    profile: str


class MigrationSection(Strict):
    enabled: bool
    drain_seconds: float = Field(gt=0)
    min_tokens: int = Field(ge=0)
    max_disk_mib: int = Field(gt=0)
    max_age_seconds: float = Field(gt=0)
    prefill_ms_per_token: float = Field(gt=0)
    transfer_mib_per_second: float = Field(gt=0)


class StackSettings(Strict):
    replicas: ReplicasSection
    gateways: GatewaysSection
    ports: PortsSection
    router: RouterSection
    check: CheckSection
    migration: MigrationSection


def load_stack_settings(path: str | Path | None = None,
                        overrides: Mapping[str, Mapping[str, Any]] | None = None) -> StackSettings:
    """stack.toml (or `path`) with `overrides` ({section: {key: value}}, None values ignored)."""
    source = Path(path) if path else REFERENCE_SETTINGS
    try:
        raw = tomllib.loads(source.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise StackError(f"stack settings {source}: {exc}") from None
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    try:
        return StackSettings.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise StackError(f"stack settings {source}: {problems}") from None


def run_dir(explicit: str | Path | None = None, data: Path | None = None) -> Path:
    """--run-dir, else $LLM_RING_RUN, else <data dir>/run."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(RUN_ENV):
        return Path(os.environ[RUN_ENV]).expanduser()
    return (data or models.data_dir()) / "run"


# ---- the running stack -----------------------------------------------------------------

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


class Stack:
    def __init__(self, state: StackState) -> None:
        self.state = state

    # -- start / find / stop

    @classmethod
    def up(cls, settings: StackSettings, data: Path, run: Path, progress: Progress = print,
           die_with_parent: bool = False) -> Stack:
        began = time.monotonic()
        existing = _read_state(run)
        if existing is not None and Stack(existing).any_alive():
            raise StackError(f"a stack is already running from {run}: `llm-ring down` first "
                             f"(or use another --run-dir)")
        rs = settings.replicas
        ports = _ports(settings.ports, rs.count, settings.gateways.count)
        gateways = layout(settings.gateways.count, run, (ports["gateway"], ports["envoy_admin"], ports["router"],
                          ports["metrics"]), settings.ports.gateway_base, ports["spare"])
        several = len(gateways) > 1
        redis = _redis_binary(settings.gateways.redis_server) if several else ""
        front = [(ports["gateway"], "the front of the gateways"), (ports["envoy_admin"], "the front's Envoy admin"),
                 (ports["store"], "the gateways' store (redis-server)")]
        check_ports_free(_distinct([
            *(front if several else []), *port_purposes(gateways),
            *((port, f"replica {replicas.replica_name(i)}") for i, port in enumerate(ports["replicas"])),
        ]))
        replica_settings = ReplicaSettings(
            backend=rs.backend, model="", ctx_size=rs.ctx_size, parallel=rs.parallel,
            threads=rs.threads, cache_ram_mib=rs.cache_ram_mib,
            llama_server=rs.llama_server or str(data / "bin" / "llama-server"),
        )
        check_slot_context(settings.check.profile, replica_settings)
        replica_settings = replace(replica_settings, model=str(models.resolve(rs.model, data, progress)))
        kv_bytes = models.kv_bytes_per_token(replica_settings.model)
        capacity = rs.ctx_size + rs.cache_ram_mib * 2**20 // kv_bytes  # what a replica holds: slots + host cache
        (run / "logs").mkdir(parents=True, exist_ok=True)
        for gw in gateways:
            gw.envoy_dir.mkdir(parents=True, exist_ok=True)
        (run / "replicas.json").unlink(missing_ok=True)
        state = StackState(
            run_dir=str(run), gateway_url=f"http://{HOST}:{ports['gateway']}",
            envoy_admin=f"{HOST}:{ports['envoy_admin']}", policy=settings.router.policy, model=rs.model,
            replica_settings=asdict(replica_settings), replica_ports={}, replica_base=settings.ports.replica_base,
            health_timeout=rs.health_timeout_seconds, die_with_parent=die_with_parent, started_at=time.time(),
            gateways=[asdict(gw) for gw in gateways], prefix_capacity_tokens=capacity,
            migration=settings.migration.model_dump(), model_sha256=models.sha256_file(Path(replica_settings.model)),
            kv_bytes_per_token=kv_bytes,
        )
        stack = cls(state)
        try:
            progress(f"starting {rs.count} {rs.backend} replica(s) of {rs.model} (ctx {rs.ctx_size}, "
                     f"{rs.parallel} slots, {rs.threads} thread(s), cache-ram {rs.cache_ram_mib} MiB: "
                     f"{capacity:,} tokens a replica at {kv_bytes:,} bytes a token, the routers' "
                     f"prefix_capacity_tokens)")
            stack._start_replicas([replicas.replica_name(i) for i in range(rs.count)], ports["replicas"], progress)
            stack._write_replica_list()
            if several:
                stack._start_store(redis, ports["store"], progress)
            for gw in stack.gateway_list:
                stack._start_router(gw, settings.router.settings, progress)
                stack._start_envoy(gw, progress)
            if several:
                stack._start_front(progress)
            stack._start_supervisor()
        except BaseException:
            stack.down()
            raise
        state.startup_seconds = time.monotonic() - began
        stack.save()
        progress(f"stack up in {state.startup_seconds:.1f}s")
        return stack

    @classmethod
    def find(cls, run: Path) -> Stack:
        state = _read_state(run)
        if state is None:
            raise StackError(f"no stack in {run} (start one with `llm-ring up`)")
        return cls(state)

    def down(self, progress: Progress = lambda _: None) -> None:
        """Stop the supervisor (first: it would restart the others), then the front, every
        gateway's Envoy and router, the store and the replicas (whole process groups); keep
        the logs."""
        supervisor = _daemon(self.state.supervisor)
        if supervisor is not None:
            stop([supervisor])
        with self.locked():
            progress(f"stopping {sum(d.alive() for d in self._daemons())} process(es)")
            stop(self._daemons())
            (Path(self.state.run_dir) / "state.json").unlink(missing_ok=True)

    @contextlib.contextmanager
    def locked(self, wait: bool = True) -> Iterator[bool]:
        """Hold the run dir's lock (the supervisor and the commands that change the stack take
        turns) with the state re-read from state.json; yields False if not waiting and busy."""
        with open(Path(self.state.run_dir) / "state.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            self.state = _read_state(Path(self.state.run_dir)) or self.state
            yield True

    def processes(self) -> dict[str, Daemon]:
        """Every supervised process by name: the front, each gateway's envoy and router (with
        one gateway "envoy" and "router", else "envoy-0", "router-0", ...), the store, llm-0, ..."""
        named = {FRONT: _daemon(self.state.front)}
        for gw in self.gateway_list:
            named |= {gw.envoy_name: _daemon(gw.envoy), gw.router_name: _daemon(gw.router)}
        named[STORE] = _daemon(self.state.store)
        return {name: d for name, d in named.items() if d is not None} | {r.name: r.process for r in self.replica_list}

    def restart(self, name: str) -> None:
        """Start a process that died again, as it was started (a replica on its port)."""
        gateway = next((gw for gw in self.gateway_list if name in (gw.router_name, gw.envoy_name)), None)
        if gateway is not None and name == gateway.router_name:
            gateway.router = asdict(self._spawn_router(gateway))
            self._keep(gateway)
        elif gateway is not None:
            gateway.envoy = asdict(self._spawn_envoy(gateway.envoy_dir / "envoy.yaml", gateway.envoy_name))
            self._keep(gateway)
        elif name == FRONT:
            self.state.front = asdict(self._spawn_envoy(Path(self.state.run_dir) / "front" / "envoy.yaml", FRONT))
        elif name == STORE:
            self.state.store = asdict(self._spawn_store())
        else:
            replica = next(r for r in self.replica_list if r.name == name)
            (started,) = replicas.start({name: replica.port}, self._settings(), Path(self.state.run_dir),
                                        die_with_parent=self.state.die_with_parent)
            self.state.replicas = [started.as_dict() if r["name"] == name else r for r in self.state.replicas]
        self.save()

    def kill_part(self, name: str) -> float:
        """SIGKILL a gateway's Envoy and routing service, or the store (name STORE): a drill,
        `llm-ring run --kill-gateway|--kill-store`; the supervisor leaves them down until
        restart_part. Returns the wall-clock time of the signal."""
        with self.locked():
            if name == STORE and _daemon(self.state.store) is not None:
                held, daemons = [STORE], [_daemon(self.state.store)]
            else:
                gateway = self._gateway(name)
                held = [gateway.router_name, gateway.envoy_name]
                daemons = [_daemon(gateway.envoy), _daemon(gateway.router)]
            self.state.held_down += held
            self.save()
            signalled = time.time()
            kill([d for d in daemons if d is not None])
        return signalled

    def restart_part(self, name: str, progress: Progress = lambda _: None) -> None:
        """Start a killed gateway or store again on its ports; returns once it answers."""
        if name == STORE:
            self._restart_store(progress)
            return
        with self.locked():
            gateway = self._gateway(name)
            held = {gateway.router_name, gateway.envoy_name}
            for process in (gateway.router, gateway.envoy):
                daemon = _daemon(process)
                if daemon is not None and daemon.alive():
                    raise StackError(f"{name} is running: kill it first")
            router = self._spawn_router(gateway)
            gateway.router = asdict(router)
            self._keep(gateway)
            self.state.held_down = [n for n in self.state.held_down if n not in held]
            self.save()
            _wait_for(router, lambda: grpc_serving(gateway.router_address), 30.0, f"the routing service of {name}")
            envoy = self._spawn_envoy(gateway.envoy_dir / "envoy.yaml", gateway.envoy_name)
            gateway.envoy = asdict(envoy)
            self._keep(gateway)
            self.save()
            _wait_for(envoy, lambda: http_ok(f"http://{gateway.envoy_admin}/ready"), 30.0, f"Envoy of {name}")
        progress(f"{name} restarted")

    def any_alive(self) -> bool:
        supervisor = _daemon(self.state.supervisor)
        return any(d.alive() for d in self._daemons()) or (supervisor is not None and supervisor.alive())

    def _daemons(self) -> list[Daemon]:
        """In stopping order: the front first (no new connections), the replicas last."""
        return list(self.processes().values())

    # -- queries

    @property
    def replica_list(self) -> list[Replica]:
        return [Replica.from_dict(r) for r in self.state.replicas]

    @property
    def gateway_list(self) -> list[GatewayState]:
        return [GatewayState(**gw) for gw in self.state.gateways]

    def healthy_replicas(self) -> dict[str, str]:
        return {r.name: r.address for r in self.replica_list if r.process.alive() and replicas.healthy(r.address)}

    def status(self) -> dict[str, Any]:
        """The stack as `status --json` prints it; "router" and "envoy" are the first gateway's
        (the only one's), "gateways" lists every gateway, "front" and "store" are there with
        several."""
        self.state = _read_state(Path(self.state.run_dir)) or self.state  # the supervisor may have restarted some
        gateways = [self._gateway_status(gw) for gw in self.gateway_list]
        several = len(gateways) > 1
        front_ready = f"http://{self.state.envoy_admin}/ready"
        return {
            "gateway_url": self.state.gateway_url,
            "metrics_url": self.state.metrics_url,
            "router_address": self.state.router_address,
            "envoy_admin": f"http://{self.state.envoy_admin}",
            "policy": self.state.policy,
            "model": self.state.model,
            "run_dir": self.state.run_dir,
            "logs": str(Path(self.state.run_dir) / "logs"),
            "startup_seconds": round(self.state.startup_seconds, 2),
            "router": gateways[0]["router"],
            "envoy": gateways[0]["envoy"],
            "gateways": gateways,
            **({
                "front": _process_status(_daemon(self.state.front), lambda: http_ok(front_ready))
                | self._restarts(FRONT),
                "store": {"url": self.state.store_url}
                | _process_status(_daemon(self.state.store), lambda: redis_answers(_port(self.state.store_url)))
                | self._restarts(STORE),
            } if several else {}),
            "supervisor": _process_status(_daemon(self.state.supervisor), lambda: True),
            "replicas": [
                {
                    "name": r.name,
                    "address": r.address,
                    "pid": r.process.pid,
                    "alive": r.process.alive(),
                    "healthy": r.process.alive() and replicas.healthy(r.address),
                    "rss_mib": round(r.process.rss_bytes() / 2**20, 1),
                    "log": r.process.log,
                    **self._restarts(r.name),
                }
                for r in self.replica_list
            ],
        }

    # -- changes while running

    def scale(self, n: int, progress: Progress = print, drain_timeout: float = 60.0) -> list[dict[str, object]]:
        """Run n replicas: new ones join once healthy; removed ones leave the list, drain, hand
        their conversations' caches to the others ([migration] enabled), stop. Returns each
        migration's outcome."""
        if n < 1:
            raise StackError(f"scale {n}: at least 1 replica")
        with self.locked():
            return self._scale(n, progress, self._drain_seconds(drain_timeout))

    def roll(self, name: str, progress: Progress = print, migrate: bool | None = None) -> dict[str, object]:
        """Restart one replica as a rolling update does: out of the list, drain, migrate its
        caches ([migration] enabled, or `migrate`), stop, start on its port, healthy, back in the
        list. Returns {"replica", "out" (left the lists), "drained" (drained and migrated), "down"
        (stopped), "up" (back), ISO times, and "migration"}."""
        with self.locked():
            current = self.replica_list
            leaving = next((r for r in current if r.name == name), None)
            if leaving is None:
                raise StackError(f"no replica {name!r}")
            staying = [r for r in current if r.name != name]
            if self.state.migration:
                self._kv_bytes_per_token()  # before it leaves: nothing slow between its leaving and its migration
            self.state.replicas = [r.as_dict() for r in staying]
            self._write_replica_list()
            self.save()
            for gw in self.gateway_list:
                self._wait_router_forgets({name}, gw.router_address)
            out = _iso(time.time())
            deadline = time.monotonic() + self._drain_seconds(60.0)
            outcome = self._migrate_draining(leaving, staying, deadline, progress, migrate)
            drained = _iso(time.time())
            replicas.stop_all([leaving])
            down = _iso(time.time())
            self.state.replicas = [r.as_dict() for r in staying]
            self._start_replicas([name], [leaving.port], progress, port_wait=5.0)
            self.state.replicas.sort(key=lambda r: int(str(r["name"]).rsplit("-", 1)[1]))
            self._write_replica_list()
            self.save()
            for gw in self.gateway_list:
                self._wait_router_knows({name}, gw.router_address)
                self._wait_envoy_knows({leaving.address}, gw.envoy_admin)
            return {"replica": name, "out": out, "drained": drained, "down": down, "up": _iso(time.time()),
                    "migration": outcome}

    def _kv_bytes_per_token(self) -> int:
        if not self.state.kv_bytes_per_token:  # a stack started before it was kept: read once, kept
            self.state.kv_bytes_per_token = models.kv_bytes_per_token(self._settings().model)
            self.save()
        return self.state.kv_bytes_per_token

    def _drain_seconds(self, fallback: float) -> float:
        return float(self.state.migration.get("drain_seconds", fallback))

    def _migrate_draining(self, leaving: Replica, staying: list[Replica], deadline: float, progress: Progress,
                          migrate: bool | None = None) -> dict[str, object]:
        """Drain `leaving` (out of the lists already) and move its caches as its slots turn idle:
        the idle ones at once, each busy one as soon as its request ends (its conversation's next
        turn may come within seconds), until none is busy or the deadline."""
        section = self.state.migration
        if not (section.get("enabled") if migrate is None else migrate) or not staying or not section:
            _drain([leaving], deadline - time.monotonic(), progress)
            return {}
        total = self._migrate(leaving, staying, deadline, lambda _: None, frozenset())
        busy = _busy_slots(leaving.address)
        while busy and time.monotonic() < deadline:
            time.sleep(0.05)
            still = _busy_slots(leaving.address)
            if still != busy:
                total.add(self._migrate(leaving, staying, deadline, lambda _: None, frozenset(total.saved_slots)))
            busy = still
        problem = f"; {total.problems[0]}" if total.problems else ""
        progress(f"drained {leaving.name}; migration: {len(total.moved)} of {total.slots} slot(s) moved "
                 f"({total.bytes:,} bytes, {total.seconds:.2f}s){problem}")
        return total.as_dict()

    def _migrate(self, leaving: Replica, staying: list[Replica], deadline: float, progress: Progress,
                 done: frozenset[int]) -> Outcome:
        from extproc.migration.migrate import Limits, SharedFolder, migrate_out
        from extproc.migration.planner import Costs
        from extproc.migration.slotfiles import Identity

        section = self.state.migration
        settings = self._settings()
        identity = Identity(self.state.model_sha256, settings.slot_context, "f16")
        costs = Costs(self._kv_bytes_per_token(), section["prefill_ms_per_token"] / 1000,
                      section["transfer_mib_per_second"] * 2**20)
        limit = int(section["max_disk_mib"]) * 2**20
        limits = Limits(int(section["min_tokens"]), limit, float(section["max_age_seconds"]), limit)
        folder = replicas.slot_folder(Path(self.state.run_dir))
        transport = SharedFolder(folder, {r.name: identity for r in staying})
        outcome = migrate_out((leaving.name, leaving.address), {r.name: r.address for r in staying},
                              [gw.router_address for gw in self.gateway_list], folder, identity, transport, costs,
                              limits, deadline, progress, done)
        return outcome

    def _scale(self, n: int, progress: Progress, drain_timeout: float) -> list[dict[str, object]]:
        current = self.replica_list
        if n > len(current):
            names = [replicas.replica_name(i) for i in range(len(current), n)]
            ports = [self.state.replica_ports.get(name) or self._new_port(i)
                     for i, name in zip(range(len(current), n), names, strict=True)]
            progress(f"scaling {len(current)} -> {n}: starting {', '.join(names)}")
            self._start_replicas(names, ports, progress, port_wait=5.0)
            self._write_replica_list()
            self.save()
            for gw in self.gateway_list:
                self._wait_router_knows(set(names), gw.router_address)
                self._wait_envoy_knows({f"{HOST}:{port}" for port in ports}, gw.envoy_admin)
        elif n < len(current):
            leaving = current[n:]
            progress(f"scaling {len(current)} -> {n}: removing {', '.join(r.name for r in leaving)}")
            if self.state.migration:
                self._kv_bytes_per_token()
            self.state.replicas = [r.as_dict() for r in current[:n]]
            self._write_replica_list()
            self.save()
            for gw in self.gateway_list:
                self._wait_router_forgets({r.name for r in leaving}, gw.router_address)
            deadline = time.monotonic() + drain_timeout
            outcomes = [self._migrate_draining(replica, current[:n], deadline, progress) for replica in leaving]
            replicas.stop_all(leaving)
            self.save()
            return [o for o in outcomes if o]
        self.save()
        return []

    def reset_caches(self, progress: Progress = print) -> float:
        """Empty every replica's prompt caches; returns the seconds it took.

        With a host-RAM prompt cache (cache_ram_mib > 0), erasing the slots is not enough
        (the RAM cache restores saved prefixes), so the replicas are restarted on their
        ports (the replica list does not change); without one, erasing the slots is a
        complete reset in milliseconds.
        """
        began = time.monotonic()
        with self.locked():
            self._reset_caches(progress)
        return time.monotonic() - began

    def _reset_caches(self, progress: Progress) -> None:
        settings = self._settings()
        current = self.replica_list
        if settings.cache_ram_mib == 0:
            for replica in current:
                replicas.erase_slots(replica.address, settings.parallel)
        else:
            progress(f"restarting {len(current)} replica(s) to empty their caches")
            replicas.stop_all(current)
            self.state.replicas = []
            self._start_replicas([r.name for r in current], [r.port for r in current], progress, port_wait=5.0)
            self.save()

    def save(self) -> None:
        path = Path(self.state.run_dir) / "state.json"
        write_atomically(path, json.dumps(asdict(self.state), indent=2) + "\n")

    # -- internals

    def _restarts(self, name: str) -> dict[str, int]:
        return {"restarts": int(self.state.restarts.get(name, {}).get("count", 0))}

    def _gateway_status(self, gw: GatewayState) -> dict[str, Any]:
        return {
            "name": gw.name, "listen": gw.listen, "router_address": gw.router_address,
            "metrics_url": gw.metrics_url, "envoy_admin": f"http://{gw.envoy_admin}",
            "router": _process_status(_daemon(gw.router), lambda: grpc_serving(gw.router_address))
            | self._restarts(gw.router_name),
            "envoy": _process_status(_daemon(gw.envoy), lambda: http_ok(f"http://{gw.envoy_admin}/ready"))
            | self._restarts(gw.envoy_name),
        }

    def _gateway(self, name: str) -> GatewayState:
        found = next((gw for gw in self.gateway_list if gw.name == name), None)
        if found is None:
            raise StackError(f"no gateway {name!r}: this stack has {', '.join(g.name for g in self.gateway_list)}")
        return found

    def _keep(self, gateway: GatewayState) -> None:
        self.state.gateways = [asdict(gateway) if gw["name"] == gateway.name else gw for gw in self.state.gateways]

    def _settings(self) -> ReplicaSettings:
        return ReplicaSettings(**self.state.replica_settings)

    def _new_port(self, index: int) -> int:
        return self.state.replica_base + index if self.state.replica_base else free_ports(1)[0]

    def _start_replicas(self, names: list[str], ports: list[int], progress: Progress, port_wait: float = 0.0) -> None:
        run = Path(self.state.run_dir)
        started = replicas.start(dict(zip(names, ports, strict=True)), self._settings(), run,
                                 die_with_parent=self.state.die_with_parent, port_wait=port_wait)
        self.state.replicas += [r.as_dict() for r in started]
        self.state.replica_ports.update({r.name: r.port for r in started})
        self.save()  # recorded before waiting: `down` from another shell finds them
        try:
            replicas.wait_healthy(started, self.state.health_timeout, progress)
        except replicas.ReplicaError:
            self.state.replicas = [r for r in self.state.replicas if r["name"] not in names]
            self.save()
            raise

    def _write_replica_list(self) -> None:
        listing = {r.name: r.address for r in self.replica_list}
        write_atomically(Path(self.state.run_dir) / "replicas.json", json.dumps(listing, sort_keys=True) + "\n")

    def _start_router(self, gw: GatewayState, base_settings: str, progress: Progress) -> None:
        from extproc.settings import SettingsError, load_settings

        run = Path(self.state.run_dir)
        base = Path(base_settings) if base_settings else ROUTER_REFERENCE
        several = len(self.state.gateways) > 1
        gw.router_settings.write_text(render_router_settings(
            base,
            policy=self.state.policy,
            admin_listen=gw.router_address,
            metrics_listen=gw.metrics_url.removeprefix("http://").removesuffix("/metrics"),
            replicas_file=run / "replicas.json",
            envoy_endpoints_file=gw.envoy_dir / "endpoints.json",
            store_url=self.state.store_url if several else None,
            store_password_file=password_file(run / STORE) if several else None,
            prefix_capacity_tokens=self.state.prefix_capacity_tokens or None,
            replica_slots=self.state.replica_settings["parallel"],
        ))
        try:
            load_settings(gw.router_settings)
        except SettingsError as exc:
            raise StackError(f"the generated router settings are invalid: {exc}") from None
        router = self._spawn_router(gw)
        gw.router = asdict(router)
        self._keep(gw)
        self.save()
        _wait_for(router, lambda: grpc_serving(gw.router_address), 30.0, "the routing service")
        self._wait_router_knows({r.name for r in self.replica_list}, gw.router_address)
        progress(f"routing service ({self.state.policy}) on {gw.router_address}")

    def _start_envoy(self, gw: GatewayState, progress: Progress) -> None:
        from extproc.envoy.config import render_envoy_config
        from extproc.envoy.contract import EndpointsFile, ext_proc_address
        from extproc.settings import load_settings

        service = load_settings(gw.router_settings).service
        endpoints = Path(service.envoy_endpoints_file)
        _wait_until(endpoints.exists, 10.0, f"the routing service did not write {endpoints}")
        config = render_envoy_config(
            listen=gw.listen, admin=gw.envoy_admin,
            ext_proc=ext_proc_address(gw.router_address, service.ext_proc_socket),
            endpoints=EndpointsFile(str(endpoints)),
            fail_open=service.fail_open, max_request_bytes=service.max_body_bytes, retries=service.fallbacks,
        )
        (gw.envoy_dir / "envoy.yaml").write_text(config)
        envoy = self._spawn_envoy(gw.envoy_dir / "envoy.yaml", gw.envoy_name)
        gw.envoy = asdict(envoy)
        self._keep(gw)
        self.save()
        _wait_for(envoy, lambda: http_ok(f"http://{gw.envoy_admin}/ready"), 30.0, "Envoy")
        progress(f"Envoy gateway on http://{gw.listen}" + (f" ({gw.name})" if len(self.state.gateways) > 1 else ""))

    def _start_front(self, progress: Progress) -> None:
        from extproc.envoy.config import render_front_config

        config = Path(self.state.run_dir) / "front" / "envoy.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(render_front_config(
            listen=self.state.gateway_url.removeprefix("http://"), admin=self.state.envoy_admin,
            gateways=[(gw.listen, gw.envoy_admin) for gw in self.gateway_list]))
        front = self._spawn_envoy(config, FRONT)
        self.state.front = asdict(front)
        self.save()
        _wait_for(front, lambda: http_ok(f"http://{self.state.envoy_admin}/ready"), 30.0, "the front Envoy")
        progress(f"front on {self.state.gateway_url}: connections spread at random over "
                 f"{len(self.state.gateways)} gateways")

    def _start_store(self, binary: str, port: int, progress: Progress) -> None:
        from extproc.stack.gateways import store_url

        (Path(self.state.run_dir) / STORE).mkdir(parents=True, exist_ok=True)
        self.state.store_url, self.state.store_binary = store_url(port), binary
        self._run_store()
        progress(f"store (redis-server) on {self.state.store_url}")

    def _restart_store(self, progress: Progress) -> None:
        with self.locked():
            old = _daemon(self.state.store)
            if old is None or old.alive():
                raise StackError("the store is running (or this stack has none): kill it first")
            self.state.held_down = [n for n in self.state.held_down if n != STORE]
            self._run_store()
        progress("store restarted")

    def _run_store(self) -> None:
        """Start the store's redis-server as the state says and wait until it answers."""
        store = self._spawn_store()
        self.state.store = asdict(store)
        self.save()
        _wait_for(store, lambda: redis_answers(_port(self.state.store_url)), 15.0, "the store (redis-server)")

    def _spawn_router(self, gw: GatewayState) -> Daemon:
        run = Path(self.state.run_dir)
        command = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(gw.router_settings)]
        return spawn(command, run / "logs" / f"{gw.router_name}.log", die_with_parent=self.state.die_with_parent)

    def _spawn_envoy(self, config: Path, name: str) -> Daemon:
        run = Path(self.state.run_dir)
        command = [envoy_binary(), "-c", str(config), "--concurrency", "2", "-l", "warning", "--disable-hot-restart"]
        return spawn(command, run / "logs" / f"{name}.log", die_with_parent=self.state.die_with_parent)

    def _spawn_store(self) -> Daemon:
        run = Path(self.state.run_dir)
        config = write_config(_port(self.state.store_url), run / STORE)  # passwords generated once, kept
        command = redis_command(self.state.store_binary, config)
        return spawn(command, run / "logs" / f"{STORE}.log", die_with_parent=self.state.die_with_parent)

    def _start_supervisor(self) -> None:
        run = Path(self.state.run_dir)
        command = [sys.executable, "-m", "extproc.stack.supervisor", str(run)]
        supervisor = spawn(command, run / "logs" / "supervisor.log", die_with_parent=self.state.die_with_parent)
        self.state.supervisor = asdict(supervisor)
        self.save()

    def _wait_router_knows(self, names: set[str], router: str) -> None:
        _wait_until(lambda: names <= _router_replicas(router), 15.0,
                    f"the routing service on {router} did not pick up {sorted(names)} from replicas.json")

    def _wait_envoy_knows(self, addresses: set[str], envoy_admin: str) -> None:
        """Envoy reads the endpoint file a moment after the router writes it; until then a pick
        of the new replica would be served by its fallback."""
        def known() -> bool:
            with urllib.request.urlopen(f"http://{envoy_admin}/clusters", timeout=2) as reply:
                listing = reply.read().decode()
            return all(f"::{address}::" in listing for address in addresses)

        _wait_until(known, 15.0, f"Envoy ({envoy_admin}) did not pick up {sorted(addresses)} from the endpoint file")

    def _wait_router_forgets(self, names: set[str], router: str) -> None:
        _wait_until(lambda: not names & _router_replicas(router), 15.0,
                    f"the routing service on {router} still lists {sorted(names)}")


def _router_replicas(router: str) -> set[str]:
    from extproc.service.admin_client import AdminClient

    with AdminClient(router) as admin:
        return {r["name"] for r in admin.state()["replicas"]}


def check_slot_context(profile_name: str, settings: ReplicaSettings) -> None:
    """The profile's conversations must fit in one slot (ctx_size / parallel), with a margin."""
    from extproc.traffic.profile import ProfileError, check_context, load_profile

    try:
        check_context(load_profile(profile_name), settings.slot_context)
    except ProfileError as exc:
        raise StackError(f"[check] profile: {exc}") from None


def render_router_settings(base: Path, *, policy: str, admin_listen: str, metrics_listen: str, replicas_file: Path,
                           envoy_endpoints_file: Path, store_url: str | None = None,
                           store_password_file: Path | None = None,
                           prefix_capacity_tokens: int | None = None, replica_slots: int | None = None) -> str:
    """The routing service's settings: `base` with this stack's addresses, files and policy.
    store_url, store_password_file (several gateways): their shared store, as [store] url and
    password_file; prefix_capacity_tokens: what this stack's replicas hold; replica_slots: their
    --parallel."""
    raw = tomllib.loads(base.read_text())
    raw["routing"]["policy"] = policy
    if prefix_capacity_tokens is not None:  # llm-aware's own settings ([routing.llm-aware])
        raw["routing"]["llm-aware"]["prefix_capacity_tokens"] = prefix_capacity_tokens
    if replica_slots is not None:
        raw["routing"]["llm-aware"]["replica_slots"] = replica_slots
    raw["service"].update(  # Envoy reaches ext_proc on the socket alone
        listen="",
        admin_listen=admin_listen,
        ext_proc_socket=socket_name(admin_listen),  # one per router: several may run on one machine
        metrics_listen=metrics_listen,
        envoy_endpoints_file=str(envoy_endpoints_file),
        routing_headers=True,  # experiments record each answer's replica, reason and prediction
    )
    raw["discovery"].update(source="file", file=str(replicas_file))
    if store_url is not None:
        raw["store"]["url"] = store_url
    if store_password_file is not None:
        raw["store"]["password_file"] = str(store_password_file)
    lines = [f"# generated by `llm-ring up` from {base}"]
    for section, values in raw.items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _ports(section: PortsSection, count: int, gateways: int) -> dict[str, Any]:
    """The stack's ports from [ports]: fixed ones as given, 0 ones free now; "spare" holds the
    free ports left for the gateways when gateway_base is 0 (gateways.layout takes them)."""
    fixed = section.model_dump()
    bases = ("replica_base", "gateway_base")
    needed = (sum(1 for key, v in fixed.items() if v == 0 and key not in bases)
              + (count if section.replica_base == 0 else 0)
              + (PORTS_PER_GATEWAY * gateways if section.gateway_base == 0 and gateways > 1 else 0))
    spare = free_ports(needed)
    named = {key: (value or spare.pop()) for key, value in fixed.items() if key not in bases}
    base = section.replica_base
    named["replicas"] = [base + i if base else spare.pop() for i in range(count)]
    named["spare"] = spare
    return named


def _distinct(purposes: list[tuple[int, str]]) -> dict[int, str]:
    """{port: purpose}; one port given two purposes (overlapping [ports]) stops start-up."""
    found: dict[int, str] = {}
    for port, what in purposes:
        if port in found:
            raise StackError(f"[ports]: port {port} is both for {found[port]} and for {what}")
        found[port] = what
    return found


def _redis_binary(configured: str) -> str:
    found = shutil.which(configured) if configured else redis_server_binary()
    if found is None:
        raise StackError(f"[gateways] redis_server: {configured or 'redis-server'} not found; several gateways "
                         "share their state in a redis-server (Debian: apt-get install redis-server)")
    return found


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _read_state(run: Path) -> StackState | None:
    path = run / "state.json"
    if not path.exists():
        return None
    try:
        return StackState(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:  # e.g. written by an llm-ring before --gateways
        raise StackError(f"{path} is not a state file of this llm-ring ({exc}); stop that stack's processes "
                         f"by hand and remove the file") from None


def _daemon(raw: Mapping[str, Any]) -> Daemon | None:
    return Daemon(**raw) if raw else None


def _process_status(daemon: Daemon | None, ready: Callable[[], bool]) -> dict[str, Any]:
    if daemon is None:
        return {"alive": False}
    alive = daemon.alive()
    return {"pid": daemon.pid, "alive": alive, "ready": alive and ready(), "log": daemon.log}


def _wait_for(daemon: Daemon, ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not daemon.alive():
            raise StackError(f"{what} exited during start-up; log {daemon.log}:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout:g}s; log {daemon.log}:\n{daemon.log_tail()}")
        time.sleep(0.05)


def _wait_until(condition: Callable[[], bool], timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise StackError(failure)
        time.sleep(0.05)


def _iso(wall: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")


def _drain(leaving: list[Replica], timeout: float, progress: Progress) -> None:
    """Wait until the leaving replicas finish what they were sent before they left the list."""
    deadline = time.monotonic() + timeout
    for replica in leaving:
        while _busy(replica.address) and time.monotonic() < deadline:
            time.sleep(0.1)
    progress(f"drained {', '.join(r.name for r in leaving)}")


def _busy_slots(address: str) -> frozenset[int]:
    try:
        with urllib.request.urlopen(f"http://{address}/slots", timeout=2.0) as reply:
            return frozenset(int(slot["id"]) for slot in json.loads(reply.read()) if slot.get("is_processing"))
    except OSError:
        return frozenset()


def _busy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/slots", timeout=2.0) as reply:
            return any(slot.get("is_processing") for slot in json.loads(reply.read()))
    except OSError:
        return False
