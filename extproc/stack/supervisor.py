"""`python -m extproc.stack.supervisor RUN_DIR`: keeps the local stack's processes running.

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

from extproc.stack.stack import Stack, StackError

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


def supervise_once(stack: Stack, now: float, log: list[str]) -> None:
    """One round under the lock: restart what died and is due; record the counts."""
    with stack.locked(wait=False) as held:
        if not held:
            return  # `scale` or `reset` is changing the stack: next round
        for name, daemon in stack.processes().items():
            if name in stack.state.held_down:
                continue  # killed on purpose (a drill): restarted by whoever killed it
            record = Restarts(**stack.state.restarts.get(name, {}))  # type: ignore[arg-type]
            if daemon.alive():
                record.still_up(now)
            elif record.due(now):
                try:
                    stack.restart(name)
                except (StackError, OSError, RuntimeError) as exc:  # e.g. its port still taken
                    log.append(f"restart of {name} failed: {exc}")
                record.restarted(now)
                log.append(f"restarted {name} (restart {record.count})")
            stack.state.restarts[name] = asdict(record)  # type: ignore[assignment]
        stack.save()


def main(run: Path) -> int:
    while (run / "state.json").exists():
        try:
            stack = Stack.find(run)
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
