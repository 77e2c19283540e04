"""The local stack: llama.cpp replicas + the routing service + Envoy, as detached processes.

Start order: replicas (until /health answers) -> replica list file -> [several gateways: the
store's redis-server] -> per gateway `llm-ring serve` (until gRPC health) and Envoy (until
its admin /ready) -> [several gateways: the front Envoy] -> the supervisor, which restarts
any of them that dies, with backoff, and counts it in the state file. Everything the other
commands need (pids, ports, URLs, settings) is kept in <run dir>/state.json, so `status`,
`scale` and `down` work from any shell.

Each room is a module: settings.py (stack.toml), state.py (state.json), ports.py, fleet.py
(the replica set; replicas.py runs one), router.py, envoy.py, store.py, supervisor.py (every
process by name, restarts, drills). ``Stack`` holds the state and ties them together.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from extproc.stack import envoy, fleet, models, ports, replicas, router, store, supervisor
from extproc.stack.daemons import Daemon, daemon_of, http_ok, process_status, stop
from extproc.stack.errors import Progress, StackError
from extproc.stack.gateways import FRONT, STORE, GatewayState, layout, port_purposes
from extproc.stack.ports import HOST
from extproc.stack.processes import grpc_serving
from extproc.stack.replicas import Replica, ReplicaSettings
from extproc.stack.settings import StackSettings, check_slot_context
from extproc.stack.state import ServedModel, StackRun, StackState, read_state, remove_state

__all__ = ["Progress", "Stack", "StackError"]


class Stack(StackRun):
    """A running stack's state (StackRun) and what starts, changes and stops its processes."""

    # -- start / find / stop

    @classmethod
    def up(cls, settings: StackSettings, data: Path, run: Path, progress: Progress = print,
           die_with_parent: bool = False) -> Stack:
        began = time.monotonic()
        existing = read_state(run)
        if existing is not None and Stack(existing).any_alive():
            raise StackError(f"a stack is already running from {run}: `llm-ring down` first "
                             f"(or use another --run-dir)")
        taken = ports.allocate(settings.ports, settings.replicas.count, settings.gateways.count)
        gateways = layout(settings.gateways.count, run, (taken["gateway"], taken["envoy_admin"], taken["router"],
                          taken["metrics"]), settings.ports.gateway_base, taken["spare"])
        redis = store.redis_binary(settings.gateways.redis_server) if len(gateways) > 1 else ""
        _check_ports(taken, gateways)
        stack = cls(_new_state(settings, data, run, taken, gateways, die_with_parent, progress))
        try:
            stack._start_all(settings, taken, redis, progress)
        except BaseException:
            stack.down()
            raise
        stack.state.startup_seconds = time.monotonic() - began
        stack.save()
        progress(f"stack up in {stack.state.startup_seconds:.1f}s")
        return stack

    def _start_all(self, settings: StackSettings, taken: dict[str, Any], redis: str, progress: Progress) -> None:
        rs, capacity = settings.replicas, self.state.prefix_capacity_tokens
        several = len(self.state.gateways) > 1
        kv_bytes = ", ".join(f"{m.alias} {m.kv_bytes_per_token:,}" for m in self.served_models())
        served = rs.models[0] if len(rs.models) == 1 else f"{', '.join(rs.models)} in turn"
        progress(f"starting {rs.count} {rs.backend} replica(s) of {served} (ctx {rs.ctx_size}, "
                 f"{rs.parallel} slots, {rs.threads} thread(s), cache-ram {rs.cache_ram_mib} MiB: "
                 f"{capacity:,} tokens a replica at bytes a token {kv_bytes}, the routers' "
                 f"routing.replicas.cache_tokens)")
        fleet.start_replicas(self, [replicas.replica_name(i) for i in range(rs.count)], taken["replicas"], progress)
        fleet.write_replica_list(self)
        if several:
            store.start_store(self, redis, taken["store"], progress)
        for gw in self.gateway_list:
            router.start_router(self, gw, settings.router.settings, progress)
            envoy.start_envoy(self, gw, progress)
        if several:
            envoy.start_front(self, progress)
        supervisor.start_supervisor(self)

    def down(self, progress: Progress = lambda _: None) -> None:
        """Stop the supervisor (first: it would restart the others), then the front, every
        gateway's Envoy and router, the store and the replicas (whole process groups); keep
        the logs."""
        watcher = daemon_of(self.state.supervisor)
        if watcher is not None:
            stop([watcher])
        with self.locked():
            progress(f"stopping {sum(d.alive() for d in self._daemons())} process(es)")
            stop(self._daemons())
            remove_state(Path(self.state.run_dir))

    def any_alive(self) -> bool:
        watcher = daemon_of(self.state.supervisor)
        return any(d.alive() for d in self._daemons()) or (watcher is not None and watcher.alive())

    def _daemons(self) -> list[Daemon]:
        """In stopping order: the front first (no new connections), the replicas last."""
        return list(self.processes().values())

    # -- the rooms, by their commands

    def processes(self) -> dict[str, Daemon]:
        return supervisor.processes(self)

    def restart(self, name: str) -> None:
        supervisor.restart(self, name)

    def kill_part(self, name: str) -> float:
        return supervisor.kill_part(self, name)

    def restart_part(self, name: str, progress: Progress = lambda _: None) -> None:
        supervisor.restart_part(self, name, progress)

    def scale(self, n: int, progress: Progress = print, drain_timeout: float = 60.0,
              migrate: bool | None = None) -> list[dict[str, object]]:
        return fleet.scale(self, n, progress, drain_timeout, migrate)

    def roll(self, name: str, progress: Progress = print, migrate: bool | None = None) -> dict[str, object]:
        return fleet.roll(self, name, progress, migrate)

    def reset_caches(self, progress: Progress = print) -> float:
        """Empty every replica's prompt caches (fleet.reset_caches); returns the seconds it took."""
        began = time.monotonic()
        with self.locked():
            fleet.reset_caches(self, progress)
        return time.monotonic() - began

    # -- queries

    def healthy_replicas(self) -> dict[str, str]:
        return {r.name: r.address for r in self.replica_list if r.process.alive() and replicas.healthy(r.address)}

    def status(self) -> dict[str, Any]:
        """The stack as `status --json` prints it; "router" and "envoy" are the first gateway's
        (the only one's), "gateways" lists every gateway, "front" and "store" are there with
        several."""
        self.state = read_state(Path(self.state.run_dir)) or self.state  # the supervisor may have restarted some
        gateways = [self._gateway_status(gw) for gw in self.gateway_list]
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
            **(self._front_and_store_status() if len(gateways) > 1 else {}),
            "supervisor": process_status(daemon_of(self.state.supervisor), lambda: True),
            "replicas": [self._replica_status(r) for r in self.replica_list],
        }

    def _front_and_store_status(self) -> dict[str, Any]:
        front_ready = f"http://{self.state.envoy_admin}/ready"
        return {
            "front": process_status(daemon_of(self.state.front), lambda: http_ok(front_ready))
            | self._restarts(FRONT),
            "store": {"url": self.state.store_url}
            | process_status(daemon_of(self.state.store), lambda: store.store_answers(self.state))
            | self._restarts(STORE),
        }

    def _replica_status(self, r: Replica) -> dict[str, Any]:
        return {
            "name": r.name,
            "model": (", ".join(m.alias for m in self.served_models()) if self.router_mode
                      else self.model_of(r.name).alias),
            "address": r.address,
            "pid": r.process.pid,
            "alive": r.process.alive(),
            "healthy": r.process.alive() and replicas.healthy(r.address),
            "rss_mib": round(r.process.rss_bytes() / 2**20, 1),
            "log": r.process.log,
            **self._restarts(r.name),
        }

    def _gateway_status(self, gw: GatewayState) -> dict[str, Any]:
        return {
            "name": gw.name, "listen": gw.listen, "router_address": gw.router_address,
            "metrics_url": gw.metrics_url, "envoy_admin": f"http://{gw.envoy_admin}",
            "router": process_status(daemon_of(gw.router), lambda: grpc_serving(gw.router_address))
            | self._restarts(gw.router_name),
            "envoy": process_status(daemon_of(gw.envoy), lambda: http_ok(f"http://{gw.envoy_admin}/ready"))
            | self._restarts(gw.envoy_name),
        }

    def _restarts(self, name: str) -> dict[str, int]:
        return {"restarts": int(self.state.restarts.get(name, {}).get("count", 0))}


def _check_ports(taken: dict[str, Any], gateways: list[GatewayState]) -> None:
    """Every port the stack will listen on is free, and none has two purposes."""
    front = [(taken["gateway"], "the front of the gateways"), (taken["envoy_admin"], "the front's Envoy admin"),
             (taken["store"], "the gateways' store (redis-server)")]
    ports.check_ports_free(ports.distinct([
        *(front if len(gateways) > 1 else []), *port_purposes(gateways),
        *((port, f"replica {replicas.replica_name(i)}") for i, port in enumerate(taken["replicas"])),
    ]))


def _new_state(settings: StackSettings, data: Path, run: Path, taken: dict[str, Any], gateways: list[GatewayState],
               die_with_parent: bool, progress: Progress) -> StackState:
    """The state of a stack about to start: its models prepared, its folders made."""
    rs = settings.replicas
    replica_settings = ReplicaSettings(
        backend=rs.backend, model="", ctx_size=rs.ctx_size, parallel=rs.parallel,
        threads=rs.threads, cache_ram_mib=rs.cache_ram_mib, slot_prompt_similarity=rs.slot_prompt_similarity,
        llama_server=rs.llama_server or str(data / "bin" / "llama-server"), batch_size=rs.batch_size,
        ubatch_size=rs.ubatch_size,
    )
    check_slot_context(settings.check.profile, replica_settings)
    served = {name: _served_model(name, data, progress) for name in dict.fromkeys(rs.models)}
    cycle = [served[name] for name in rs.models]
    adapters = tuple(_adapter(name, rs.models, data, progress) for name in rs.lora)
    replica_settings = replace(replica_settings, model=cycle[0].path, alias=cycle[0].alias,
                               models_dir=_models_dir(run, served.values()) if rs.models_max else "",
                               models_max=rs.models_max, sleep_idle_seconds=rs.sleep_idle_seconds, lora=adapters)
    # what a replica holds (slots + host cache), for the routers: the least of the models'
    capacity = min(rs.ctx_size + rs.cache_ram_mib * 2**20 // model.kv_bytes_per_token for model in served.values())
    (run / "logs").mkdir(parents=True, exist_ok=True)
    for gw in gateways:
        gw.envoy_dir.mkdir(parents=True, exist_ok=True)
    (run / fleet.REPLICA_LIST).unlink(missing_ok=True)
    return StackState(
        run_dir=str(run), gateway_url=f"http://{HOST}:{taken['gateway']}",
        envoy_admin=f"{HOST}:{taken['envoy_admin']}", policy=settings.router.policy, model=", ".join(rs.models),
        replica_settings=asdict(replica_settings), replica_ports={}, replica_base=settings.ports.replica_base,
        health_timeout=rs.health_timeout_seconds, die_with_parent=die_with_parent, started_at=time.time(),
        gateways=[asdict(gw) for gw in gateways], prefix_capacity_tokens=capacity,
        migration=settings.migration.model_dump(), models=[asdict(model) for model in cycle],
    )


def _models_dir(run: Path, served: Iterable[ServedModel]) -> str:
    """Router mode's --models-dir: each served model linked as <its name>.gguf (llama.cpp names a
    folder's models by their files' stems)."""
    folder = run / "models"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for model in served:
        (folder / f"{model.alias}.gguf").symlink_to(Path(model.path).resolve())
    return str(folder)


def _adapter(name: str, served: tuple[str, ...], data: Path, progress: Progress) -> str:
    """The path of a LoRA adapter of [replicas] lora, prepared; StackError for a known adapter
    made for another model than one the replicas serve."""
    base = models.MODELS[name].base if name in models.MODELS else ""
    others = sorted({model for model in served if base and model != base})
    if others:
        raise StackError(f"[replicas] lora: {name!r} is made for {base!r}, and the replicas also serve "
                         f"{', '.join(others)}: every replica loads every adapter")
    return str(models.resolve(name, data, progress, adapter=True))


def _served_model(name: str, data: Path, progress: Progress) -> ServedModel:
    """A model of [replicas] model, prepared: served under its name (a file's: its stem)."""
    path = models.resolve(name, data, progress)
    return ServedModel(str(path), path.stem, models.sha256_file(path), models.kv_bytes_per_token(path))
