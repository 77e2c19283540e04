"""The local stack as the experiment runner's Lab (it has the methods of
extproc.experiments.lab.Lab; the stack imports nothing of the experiments).

``LocalLab.attach()`` drives a stack started by `llm-ring up` (found through its run dir;
StackError when there is none); ``LocalLab.start(...)`` starts one for the caller and stops
it on close (demo, tests). With several gateways, policy and reset go to every routing
service, and it has the methods of extproc.experiments.lab.GatewayTier (kill and restart one
gateway, every router's in-flight load and decisions).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from extproc.stack import models, store
from extproc.stack.errors import Progress
from extproc.stack.settings import StackSettings, run_dir
from extproc.stack.stack import Stack

IDLE_WAIT_S = 30.0  # a reset waits this long at most for the last run's requests to end
WRITES_LAND_S = 0.2  # a router's writer sends what it queued every 10 ms (service/store_writer.py)


class LocalLab:
    def __init__(self, stack: Stack, owned: bool = False, progress: Progress = print) -> None:
        self.stack = stack
        self.owned = owned  # stopped on close()
        self.progress = progress

    @classmethod
    def attach(cls, run: str | Path | None = None, progress: Progress = print) -> LocalLab:
        return cls(Stack.find(run_dir(run)), progress=progress)

    @classmethod
    def start(cls, settings: StackSettings, data: Path | None = None, run: Path | None = None,
              progress: Progress = print) -> LocalLab:
        """A stack of this process's own: its processes die with this process's main thread."""
        data = data or models.data_dir()
        stack = Stack.up(settings, data, run or run_dir(None, data), progress, die_with_parent=True)
        return cls(stack, owned=True, progress=progress)

    @property
    def gateway_url(self) -> str:
        return self.stack.state.gateway_url

    def set_policy(self, routing: dict[str, Any]) -> None:
        for address in self.routers().values():
            with _admin(address) as admin:
                admin.set_routing(routing)
        if "policy" in routing:
            self.stack.state.policy = str(routing["policy"])
            self.stack.save()

    def reset(self) -> None:
        """Fresh replica caches (see Stack.reset_caches), then fresh router state: each router's once
        none holds a request in flight (a request's end is written to the store), then, with
        several gateways, what their store holds of conversations, after the routers' last writes."""
        seconds = self.stack.reset_caches(self.progress)
        deadline = time.monotonic() + IDLE_WAIT_S
        while any(s["in_flight_requests"] for s in self.router_states().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for address in self.routers().values():
            with _admin(address) as admin:
                admin.reset()
        if self.stack.state.store_url:
            time.sleep(WRITES_LAND_S)
            store.forget_conversations(self.stack.state)
        self.progress(f"caches and router state reset in {seconds:.1f}s")

    def scale(self, n: int) -> None:
        self.stack.scale(n, self.progress)

    def roll(self, name: str, migrate: bool | None) -> dict[str, Any]:
        return self.stack.roll(name, self.progress, migrate)

    def scale_in(self, n: int, migrate: bool | None) -> list[dict[str, Any]]:
        """Down to ``n`` replicas; each removed one's step (out, drained, down, migration)."""
        return self.stack.scale(n, self.progress, migrate=migrate)

    def replicas(self) -> dict[str, str]:
        return self.stack.healthy_replicas()

    def replica_headers(self) -> dict[str, str]:
        from extproc.migration.llama import key_headers
        from extproc.stack.replicas import api_key

        return key_headers(api_key(Path(self.stack.state.run_dir)))

    def routers(self) -> dict[str, str]:
        """Every gateway's routing service: {gateway name: gRPC address}."""
        return {gw.name: gw.router_address for gw in self.stack.gateway_list}

    def kill_part(self, name: str) -> float:
        return self.stack.kill_part(name)

    def restart_part(self, name: str) -> None:
        self.stack.restart_part(name, self.progress)

    def router_states(self) -> dict[str, dict[str, int]]:
        """Per gateway, its router's in-flight requests and tokens and its decisions so far."""
        found = {}
        for name, address in self.routers().items():
            with _admin(address) as admin:
                state = admin.state()
            found[name] = {key: int(state[key]) for key in ("in_flight_requests", "in_flight_tokens", "decisions")}
        return found

    def close(self) -> None:
        if self.owned:
            self.stack.down(self.progress)

    def __enter__(self) -> LocalLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _admin(address: str) -> Any:
    from extproc.service.admin_client import AdminClient

    return AdminClient(address)
