"""llama.cpp server replicas on loopback ports: command lines, health, start, stop.

Two backends share one command line (the flag names are llama-server's):
- ``xllamacpp``: ``python -m extproc.stack.xllamacpp_server`` (PyPI wheel, no compiler);
- ``llama-server``: llama.cpp's own binary, given by path (see llama_build.py).

Every replica wants an API key (``--api-key-file``): without it llama.cpp answers 401 to
everything but /health, its slot actions among them (docs/security.md#the-replicas-api-key).
The key is generated once into the run directory (``api_key_file``, mode 0600); the stack's
Envoy adds it to the generations it forwards, and the stack's own callers send it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from extproc.files import private_secret
from extproc.stack.daemons import Daemon, http_ok, spawn, stop
from extproc.stack.ports import HOST, check_ports_free

Backend = Literal["xllamacpp", "llama-server"]


class ReplicaError(RuntimeError):
    """A replica did not become healthy; the message names it and carries its log's end."""


@dataclass(frozen=True)
class ReplicaSettings:
    backend: Backend
    model: str  # path of the GGUF file
    ctx_size: int  # total context of a replica, shared by its slots
    parallel: int  # slots
    threads: int
    cache_ram_mib: int  # host-RAM prompt cache (0 = off)
    # a new prompt takes the idle slot sharing more than this share of it, else the least recently used
    slot_prompt_similarity: float = 0.1
    llama_server: str = ""  # backend llama-server: the binary
    alias: str = ""  # the model's served name (answers' "model", GET /v1/models); "": the file's stem
    # prompt tokens one step of the server loop takes (--batch-size; llama.cpp's default 2048), and
    # one compute pass of it (--ubatch-size; 512): a request arriving mid-step waits for the step
    batch_size: int = 2048
    ubatch_size: int = 512
    # router mode (docs/fleets.md): the folder of every model served, and how many run at once
    models_dir: str = ""
    models_max: int = 0
    sleep_idle_seconds: int = 0  # > 0: the model and its cache are unloaded after this many idle seconds
    # LoRA adapters (GGUF paths), loaded at scale 0 (--lora-scaled FILE:0): a request's "lora" names
    # them by their index here; a request without it gets the base model
    lora: tuple[str, ...] = ()

    @property
    def served_name(self) -> str:
        return self.alias or Path(self.model).stem

    @property
    def slot_context(self) -> int:
        return self.ctx_size // self.parallel


@dataclass(frozen=True)
class Replica:
    name: str
    port: int
    process: Daemon

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "port": self.port, **asdict(self.process)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Replica:
        process = Daemon(int(raw["pid"]), float(raw["started"]), str(raw["log"]))
        return cls(str(raw["name"]), int(raw["port"]), process)


def replica_name(index: int) -> str:
    return f"llm-{index}"


def replica_index(name: str) -> int:
    """llm-<index> -> index."""
    return int(name.rsplit("-", 1)[1])


def command(settings: ReplicaSettings, port: int, slot_dir: Path, key_file: Path) -> list[str]:
    if settings.backend == "xllamacpp":
        program = [sys.executable, "-m", "extproc.stack.xllamacpp_server"]
    elif settings.llama_server and Path(settings.llama_server).is_file():
        program = [settings.llama_server]
    else:
        raise ReplicaError(f"backend llama-server: no binary at {settings.llama_server!r} "
                           f"(build one: llm-ring models build-llama-server)")
    served = (["--models-dir", settings.models_dir, "--models-max", str(settings.models_max)] if settings.models_dir
              else ["--model", settings.model, "--alias", settings.served_name])
    return [
        *program,
        *served,
        "--host", HOST,
        "--port", str(port),
        "--ctx-size", str(settings.ctx_size),
        "--parallel", str(settings.parallel),
        "--threads", str(settings.threads),
        "--batch-size", str(settings.batch_size),
        "--ubatch-size", str(settings.ubatch_size),
        "--cache-ram", str(settings.cache_ram_mib),
        "--slot-prompt-similarity", str(settings.slot_prompt_similarity),
        "--slot-save-path", str(slot_dir),  # enables the /slots actions
        "--api-key-file", str(key_file),  # ... for the key's holders alone
        "--metrics",
        *(["--sleep-idle-seconds", str(settings.sleep_idle_seconds)] if settings.sleep_idle_seconds else []),
        *(flag for path in settings.lora for flag in ("--lora-scaled", f"{path}:0")),
    ]


def start(names_ports: Mapping[str, int], settings: ReplicaSettings, run_dir: Path,
          die_with_parent: bool = False, port_wait: float = 0.0, key_file: Path | None = None) -> list[Replica]:
    """Spawn the replicas (not waiting): PortInUse first if a port stays taken for `port_wait` s.
    key_file: the API key they want (None: the run directory's, made on first use)."""
    check_ports_free({port: f"replica {name}" for name, port in names_ports.items()}, port_wait)
    started = []
    slot_dir = slot_folder(run_dir)  # one folder for all: a slot saved by one is restored by another
    slot_dir.mkdir(parents=True, exist_ok=True)
    if key_file is None:
        key_file = api_key_file(run_dir)
        private_secret(key_file)
    for name, port in names_ports.items():
        process = spawn(command(settings, port, slot_dir, key_file), run_dir / "logs" / f"{name}.log",
                        die_with_parent=die_with_parent)
        started.append(Replica(name, port, process))
    return started


def slot_folder(run_dir: Path) -> Path:
    return run_dir / "slots"


def api_key_file(run_dir: Path) -> Path:
    """The replicas' API key (their --api-key-file): one for every replica of the run directory."""
    return run_dir / "replica-api-key"


def api_key(run_dir: Path) -> str:
    """The key the run directory's replicas want (made by start)."""
    return private_secret(api_key_file(run_dir))


def wait_healthy(replicas: Sequence[Replica], timeout: float, progress: Callable[[str], None] = print) -> float:
    """Block until every replica answers /health 200; ReplicaError (after stopping them) if not."""
    began = time.monotonic()
    waiting = list(replicas)
    while waiting:
        for replica in list(waiting):
            if healthy(replica.address):
                waiting.remove(replica)
                progress(f"{replica.name} healthy on {replica.address} after {time.monotonic() - began:.1f}s")
            elif not replica.process.alive():
                stop_all(replicas)
                raise ReplicaError(f"replica {replica.name} (port {replica.port}) exited during start-up; "
                                   f"log {replica.process.log}:\n{replica.process.log_tail()}")
        if waiting and time.monotonic() - began > timeout:
            stop_all(replicas)
            late = waiting[0]
            raise ReplicaError(f"replica {late.name} not healthy after {timeout:g}s; log {late.process.log}:\n"
                               f"{late.process.log_tail()}")
        if waiting:
            time.sleep(0.1)
    return time.monotonic() - began


def stop_all(started: Sequence[Replica]) -> None:
    """Stop the replicas' process groups (SIGTERM, SIGKILL after 5 s)."""
    stop([r.process for r in started])


def healthy(address: str, timeout: float = 1.0) -> bool:
    return http_ok(f"http://{address}/health", timeout)


def erase_slots(address: str, parallel: int, key: str) -> None:
    """Empty each slot's KV cache. NOT a full reset: the host-RAM prompt cache (--cache-ram)
    survives and restores saved prefixes (measured), hence reset = restart (stack.reset)."""
    from extproc.migration.llama import LlamaServer

    server = LlamaServer(address, timeout=5.0, key=key)
    for slot in range(parallel):
        server.erase(slot)
