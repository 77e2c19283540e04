"""The local stack's processes by name, started again when they die or after a drill
(`python -m extproc.stack.supervisor RUN_DIR` keeps them running).

Started by `llm-ring up` (stopped first by `llm-ring down`). Every TICK_S it looks at each
gateway's router and Envoy, the front and the store (several gateways) and each replica of
the stack in RUN_DIR, except those held down on purpose (`llm-ring run --kill-gateway`); one
that died is started again as it was (a replica on its port): at once the first time, then
after 1, 2, 4 ... s, at most MAX_DELAY_S, until it has stayed up STABLE_S. Restarts are
counted in state.json (``restarts``), which `llm-ring status` shows. A restarted router rebuilds its state from
discovery (the replica list file): in-flight load and placement memory start empty.
It takes the run dir's lock for each round, so `scale` and `reset` never race it; it exits
when the stack's state file is gone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from extproc.stack import replicas
from extproc.stack.daemons import Daemon, daemon_of, http_ok, kill, spawn, wait_for
from extproc.stack.envoy import front_config, spawn_envoy
from extproc.stack.errors import Progress, StackError
from extproc.stack.gateways import FRONT, STORE
from extproc.stack.processes import grpc_serving
from extproc.stack.router import spawn_router
from extproc.stack.state import StackRun
from extproc.stack.store import restart_store, spawn_store

TICK_S = 1.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_S = 60.0  # up this long after a restart: the next death restarts at once again


@dataclass
class Restarts:
    count: int = 0  # restarts so far
    consecutive: int = 0  # restarts without STABLE_S of life in between
    last: float = 0.0  # wall clock of the last restart

    def due(self, now: float) -> bool:
        """May a dead process be started again at ``now``?"""
        if self.consecutive == 0:
            return True
        return now >= self.last + min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (self.consecutive - 1))

    def restarted(self, now: float) -> None:
        self.count += 1
        self.consecutive += 1
        self.last = now

    def still_up(self, now: float) -> None:
        if self.consecutive and now - self.last >= STABLE_S:
            self.consecutive = 0


def processes(stack: StackRun) -> dict[str, Daemon]:
    """Every supervised process by name: the front, each gateway's envoy and router (with
    one gateway "envoy" and "router", else "envoy-0", "router-0", ...), the store, llm-0, ...
    In stopping order: the front first (no new connections), the replicas last."""
    named = {FRONT: daemon_of(stack.state.front)}
    for gw in stack.gateway_list:
        named |= {gw.envoy_name: daemon_of(gw.envoy), gw.router_name: daemon_of(gw.router)}
    named[STORE] = daemon_of(stack.state.store)
    return {name: d for name, d in named.items() if d is not None} | {r.name: r.process for r in stack.replica_list}


def restart(stack: StackRun, name: str) -> None:
    """Start a process that died again, as it was started (a replica on its port)."""
    state = stack.state
    gateway = next((gw for gw in stack.gateway_list if name in (gw.router_name, gw.envoy_name)), None)
    if gateway is not None and name == gateway.router_name:
        gateway.router = asdict(spawn_router(state, gateway))
        stack.keep(gateway)
    elif gateway is not None:
        gateway.envoy = asdict(spawn_envoy(state, gateway.envoy_dir / "envoy.yaml", gateway.envoy_name))
        stack.keep(gateway)
    elif name == FRONT:
        state.front = asdict(spawn_envoy(state, front_config(state), FRONT))
    elif name == STORE:
        state.store = asdict(spawn_store(state))
    else:
        replica = next(r for r in stack.replica_list if r.name == name)
        (started,) = replicas.start({name: replica.port}, stack.replica_settings(name), Path(state.run_dir),
                                    die_with_parent=state.die_with_parent)
        state.replicas = [started.as_dict() if r["name"] == name else r for r in state.replicas]
    stack.save()


def kill_part(stack: StackRun, name: str) -> float:
    """SIGKILL a gateway's Envoy and routing service, or the store (name STORE): a drill,
    `llm-ring run --kill-gateway|--kill-store`; the supervisor leaves them down until
    restart_part. Returns the wall-clock time of the signal."""
    with stack.locked():
        store = daemon_of(stack.state.store)
        daemons: list[Daemon | None]
        if name == STORE and store is not None:
            held, daemons = [STORE], [store]
        else:
            gateway = stack.gateway(name)
            held = [gateway.router_name, gateway.envoy_name]
            daemons = [daemon_of(gateway.envoy), daemon_of(gateway.router)]
        stack.state.held_down += held
        stack.save()
        signalled = time.time()
        kill([d for d in daemons if d is not None])
    return signalled


def restart_part(stack: StackRun, name: str, progress: Progress) -> None:
    """Start a killed gateway or store again on its ports; returns once it answers."""
    if name == STORE:
        restart_store(stack, progress)
        return
    with stack.locked():
        gateway = stack.gateway(name)
        held = {gateway.router_name, gateway.envoy_name}
        for process in (gateway.router, gateway.envoy):
            daemon = daemon_of(process)
            if daemon is not None and daemon.alive():
                raise StackError(f"{name} is running: kill it first")
        router = spawn_router(stack.state, gateway)
        gateway.router = asdict(router)
        stack.keep(gateway)
        stack.state.held_down = [n for n in stack.state.held_down if n not in held]
        stack.save()
        wait_for(router, lambda: grpc_serving(gateway.router_address), 30.0, f"the routing service of {name}")
        envoy = spawn_envoy(stack.state, gateway.envoy_dir / "envoy.yaml", gateway.envoy_name)
        gateway.envoy = asdict(envoy)
        stack.keep(gateway)
        stack.save()
        wait_for(envoy, lambda: http_ok(f"http://{gateway.envoy_admin}/ready"), 30.0, f"Envoy of {name}")
    progress(f"{name} restarted")


def start_supervisor(stack: StackRun) -> None:
    run = Path(stack.state.run_dir)
    command = [sys.executable, "-m", "extproc.stack.supervisor", str(run)]
    supervisor = spawn(command, run / "logs" / "supervisor.log", die_with_parent=stack.state.die_with_parent)
    stack.state.supervisor = asdict(supervisor)
    stack.save()


def supervise_once(stack: StackRun, now: float, log: list[str]) -> None:
    """One round under the lock: restart what died and is due; record the counts."""
    with stack.locked(wait=False) as held:
        if not held:
            return  # `scale` or `reset` is changing the stack: next round
        for name, daemon in processes(stack).items():
            if name in stack.state.held_down:
                continue  # killed on purpose (a drill): restarted by whoever killed it
            record = Restarts(**stack.state.restarts.get(name, {}))  # type: ignore[arg-type]
            if daemon.alive():
                record.still_up(now)
            elif record.due(now):
                try:
                    restart(stack, name)
                except (StackError, OSError, RuntimeError) as exc:  # e.g. its port still taken
                    log.append(f"restart of {name} failed: {exc}")
                record.restarted(now)
                log.append(f"restarted {name} (restart {record.count})")
            stack.state.restarts[name] = asdict(record)  # type: ignore[assignment]
        stack.save()


def main(run: Path) -> int:

    while (run / "state.json").exists():
        try:
            stack = StackRun.find(run)
        except StackError:
            return 0
        messages: list[str] = []
        supervise_once(stack, time.time(), messages)
        for message in messages:
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}", flush=True)
        time.sleep(TICK_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
