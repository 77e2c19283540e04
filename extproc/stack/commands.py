"""`llm-ring up | status | down | scale N`: the local stack from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from extproc.routing import POLICIES
from extproc.stack import models
from extproc.stack.errors import StackError
from extproc.stack.ports import PortInUse
from extproc.stack.processes import StartError
from extproc.stack.replicas import ReplicaError
from extproc.stack.settings import load_stack_settings, run_dir
from extproc.stack.stack import Stack

FAILURES = (StackError, ReplicaError, PortInUse, models.ModelError, StartError)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help=f"models and default run dir (${models.DATA_ENV}, "
                                           "default ~/.local/share/llm-ring)")
    parser.add_argument("--run-dir", help="the stack's state and logs ($LLM_RING_RUN, default <data dir>/run)")


def configure_up(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--settings", metavar="FILE", help="stack settings (default extproc/stack/stack.toml)")
    parser.add_argument("--replicas", type=int, help="replicas to start ([replicas] count)")
    parser.add_argument("--gateways", type=int, metavar="N",
                        help="gateway pairs (Envoy + routing service) behind one front listener ([gateways] count)")
    parser.add_argument("--backend", choices=("xllamacpp", "llama-server"), help="[replicas] backend")
    parser.add_argument("--llama-server", metavar="PATH", help="backend llama-server: the binary")
    served = [name for name, spec in models.MODELS.items() if not spec.adapter]
    parser.add_argument("--model", help=f"{' | '.join(served)} | a .gguf path, or several comma-separated: "
                                        "the models the replicas serve in turn ([replicas] model)")
    parser.add_argument("--lora", help="LoRA adapters every replica loads, comma-separated: names from "
                                       "`llm-ring models list` or .gguf paths ([replicas] lora)")
    parser.add_argument("--policy", choices=list(POLICIES), help="routing policy ([router] policy)")
    parser.add_argument("--ctx-size", type=int, help="[replicas] ctx_size")
    parser.add_argument("--parallel", type=int, help="[replicas] parallel (slots)")
    parser.add_argument("--threads", type=int, help="[replicas] threads")
    parser.add_argument("--cache-ram", type=int, metavar="MIB", help="[replicas] cache_ram_mib")
    parser.add_argument("--models-max", type=int, metavar="N",
                        help="router mode: every replica serves every model, N loaded at once ([replicas] models_max)")
    parser.add_argument("--sleep-idle-seconds", type=int, metavar="S",
                        help="replicas unload their model after S idle seconds ([replicas] sleep_idle_seconds)")
    parser.add_argument("--profile", help="[check] profile whose max_context_tokens must fit a slot")


def main_up(args: argparse.Namespace) -> int:
    data = models.data_dir(args.data_dir)
    try:
        settings = load_stack_settings(args.settings, {
            "replicas": {"count": args.replicas, "backend": args.backend, "llama_server": args.llama_server,
                         "model": _models(args.model), "ctx_size": args.ctx_size, "parallel": args.parallel,
                         "threads": args.threads, "cache_ram_mib": args.cache_ram, "models_max": args.models_max,
                         "sleep_idle_seconds": args.sleep_idle_seconds,
                         "lora": args.lora.split(",") if args.lora else None},
            "gateways": {"count": args.gateways},
            "router": {"policy": args.policy},
            "check": {"profile": args.profile},
        })
        stack = Stack.up(settings, data, run_dir(args.run_dir, data), _progress)
    except FAILURES as exc:
        print(f"llm-ring up: {exc}", file=sys.stderr)
        return 1
    status = stack.status()
    print(f"gateway:  {status['gateway_url']}  (POST /v1/chat/completions)")
    if "front" in status:
        for gateway in status["gateways"]:
            print(f"{gateway['name']}:     http://{gateway['listen']}   metrics {gateway['metrics_url']}   "
                  f"admin {gateway['router_address']} (gRPC)   envoy admin {gateway['envoy_admin']}")
        print(f"front:    envoy admin {status['envoy_admin']}   store: {status['store']['url']}")
        print(f"logs:     {status['logs']}/ (router-N.log, envoy-N.log, front.log, store.log, llm-N.log)")
    else:
        print(f"metrics:  {status['metrics_url']}")
        print(f"admin:    {status['router_address']} (gRPC)   envoy admin: {status['envoy_admin']}")
        print(f"logs:     {status['logs']}/ (router.log, envoy.log, llm-N.log)")
    listed = (f"{r['name']}={r['address']} ({r['model']})" for r in status["replicas"])
    print(f"replicas: {', '.join(listed)}")
    print("stop with: llm-ring down")
    return 0


def _models(given: str | None) -> str | list[str] | None:
    """--model: one model, or the comma-separated models the replicas serve in turn."""
    return given.split(",") if given and "," in given else given


def configure_status(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def main_status(args: argparse.Namespace) -> int:
    try:
        stack = Stack.find(run_dir(args.run_dir, models.data_dir(args.data_dir)))
    except StackError as exc:
        if args.json:
            print(json.dumps({"running": False, "error": str(exc)}))
        else:
            print(f"llm-ring status: {exc}", file=sys.stderr)
        return 1
    status = stack.status()
    if args.json:
        print(json.dumps({"running": True, **status}))
        return 0
    print(f"gateway  {status['gateway_url']}   metrics {status['metrics_url']}   policy {status['policy']}"
          f"   model {status['model']}")
    several = "front" in status
    for gateway in status["gateways"]:
        for kind in ("router", "envoy"):
            process = gateway[kind]
            name = f"{kind}-{gateway['name'].removeprefix('gw-')}" if several else kind
            where = f"  {gateway['router_address'] if kind == 'router' else gateway['listen']}" if several else ""
            print(f"  {name:<8} pid {process.get('pid', '-'):<8} {_state(process['alive'], process.get('ready'))}"
                  f"{where}  restarts {process['restarts']}")
    if several:
        for name in ("front", "store"):
            process = status[name]
            print(f"  {name:<8} pid {process.get('pid', '-'):<8} {_state(process['alive'], process.get('ready'))}"
                  f"  restarts {process['restarts']}")
    for replica in status["replicas"]:
        print(f"  {replica['name']:<8} pid {replica['pid']:<8} {_state(replica['alive'], replica['healthy'])}"
              f"  {replica['address']}  {replica['model']}  rss {replica['rss_mib']} MiB"
              f"  restarts {replica['restarts']}")
    supervisor = status["supervisor"]
    print(f"  {'supervisor':<8} pid {supervisor.get('pid', '-'):<8} {'running' if supervisor['alive'] else 'DEAD'}"
          "  (restarts what dies)")
    print(f"logs in {status['logs']}")
    return 0


def configure_down(parser: argparse.ArgumentParser) -> None:
    _common(parser)


def main_down(args: argparse.Namespace) -> int:
    try:
        stack = Stack.find(run_dir(args.run_dir, models.data_dir(args.data_dir)))
    except StackError as exc:
        print(f"llm-ring down: {exc}", file=sys.stderr)
        return 0  # nothing to stop is not a failure
    stack.down(_progress)
    print("stack stopped")
    return 0


def configure_scale(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("n", type=int, help="number of replicas to run")


def main_scale(args: argparse.Namespace) -> int:
    try:
        stack = Stack.find(run_dir(args.run_dir, models.data_dir(args.data_dir)))
        for step in stack.scale(args.n, _progress):
            outcome = step["migration"]
            if not isinstance(outcome, dict) or not outcome:  # no migration
                continue
            print(f"migrated from {outcome['replica']}: {outcome['succeeded']} of {outcome['slots']} slot(s), "
                  f"{outcome['failed']} failed, {outcome['bytes']:,} bytes, {outcome['seconds']} s")
    except FAILURES as exc:
        print(f"llm-ring scale: {exc}", file=sys.stderr)
        return 1
    print(f"replicas: {', '.join(r.name + '=' + r.address for r in stack.replica_list)}")
    return 0


def _state(alive: bool, ready: bool | None) -> str:
    if not alive:
        return "DEAD"
    return "ready" if ready else "NOT READY"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
