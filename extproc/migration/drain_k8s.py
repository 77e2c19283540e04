"""A Kubernetes replica's slot sidecar, and the drain its pod runs before llama-server stops.

The sidecar (sidecar.py) runs beside llama-server in each replica's pod, on the pod's slot
volume. When the pod terminates, the llama container's preStop hook calls the sidecar's
GET /drain, and llama-server gets its SIGTERM only once that answers. The drain:

1. waits until this pod's endpoint is terminating in the replicas' EndpointSlices, then
   settle_seconds more. The routers watch the same slices: from then on they list it as
   leaving (discovery.leaving_seconds), send it no new conversation, and send it the
   follow-ups of its conversations whose cache has not moved yet;
2. reads, from the same API, the replicas that stay (llama-server and sidecar ports) and every
   router's migration port (the EndpointSlices of migration.routers_service), and keeps the
   replicas whose sidecar names this pod's identity (GET /identity: the same model, slot context
   and KV type; the Service lists every model's replicas of a fleet of several);
3. moves the conversations of its slots as they turn idle, the idle ones at once, each busy one
   when its request ends (migrate.migrate_while_draining; transport: the receivers' sidecars
   fetch from this one), every router told where each one went;
4. tells every router its drain is over (``Migrated(drained=<pod>)``: nothing more is sent
   here), waits for the requests still in flight, and answers;

all within migration.drain_seconds. A failure at any step (no API, no router, no receiver)
leaves what the pod had without migration: its requests in flight finish, its caches are lost.
A /drain on a pod that is not terminating is refused (409) and moves nothing.

    python -m extproc.migration.drain_k8s --config /etc/llm-ring/slots.toml

Besides the config: POD_NAME and POD_IP (the downward API), and the replica's own settings
from the llm-config ConfigMap (MODEL_FILE, LLAMA_ARG_CTX_SIZE, LLAMA_ARG_N_PARALLEL,
LLAMA_ARG_PORT, LLAMA_ARG_CACHE_TYPE_K when set), so the slot identity is the one llama-server runs with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from extproc.migration import slotfiles
from extproc.migration.llama import LlamaServer, SlotError
from extproc.migration.migrate import Limits, Outcome, migrate_out, migrate_while_draining, tell_drained
from extproc.migration.planner import Costs
from extproc.migration.settings import SlotSidecarSettings, load_sidecar_settings
from extproc.migration.sidecar import Sidecars, SidecarSettings, identity_of, make_server
from extproc.settings import SettingsError, read_secret_file

POLL_SECONDS = 0.2
API_TIMEOUT = (5.0, 10.0)  # connect, read


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str
    llama: str  # llama-server in this pod, host:port
    identity: slotfiles.Identity


def pod_from_environment(environ: Mapping[str, str], model_folder: Path) -> Pod:
    """This pod, from the downward API and llm-config's variables; the model file is hashed."""
    needed = ("POD_NAME", "POD_IP", "MODEL_FILE", "LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_N_PARALLEL", "LLAMA_ARG_PORT")
    missing = [name for name in needed if not environ.get(name)]
    if missing:
        raise SettingsError(f"slot sidecar: environment variable(s) {', '.join(missing)} missing "
                            "(the downward API and the llm-config ConfigMap set them)")
    model = model_folder / environ["MODEL_FILE"]
    try:
        with open(model, "rb") as handle:
            sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as exc:
        raise SettingsError(f"slot sidecar: cannot read the model {model}: {exc.strerror}") from None
    slot_context = int(environ["LLAMA_ARG_CTX_SIZE"]) // int(environ["LLAMA_ARG_N_PARALLEL"])
    identity = slotfiles.Identity(sha256, slot_context, environ.get("LLAMA_ARG_CACHE_TYPE_K") or "f16")
    return Pod(environ["POD_NAME"], environ["POD_IP"], f"127.0.0.1:{environ['LLAMA_ARG_PORT']}", identity)


@dataclass(frozen=True)
class Neighbours:
    leaving: bool  # this pod is out of the replicas' lists (terminating, or not listed)
    replicas: dict[str, str]  # the replicas that stay: name -> llama-server host:port
    sidecars: dict[str, str]  # name -> sidecar host:port (the same names)
    routers: list[str]  # every ready router's migration port, host:port


def neighbours(api: Any, settings: SlotSidecarSettings, pod: str) -> Neighbours:
    """What a drain needs to know, read through the API (EndpointSlices: get/list only)."""
    from kubernetes import client

    from extproc.discovery.kubernetes import SERVICE_NAME_LABEL, replicas_from_slices

    section = settings.sidecar
    discovery = client.DiscoveryV1Api(api)

    def slices(service: str) -> list[Any]:
        return list(discovery.list_namespaced_endpoint_slice(
            section.namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}", _request_timeout=API_TIMEOUT).items)

    replica_slices = slices(section.replicas_service)
    replicas = replicas_from_slices(replica_slices, section.replica_port_name)
    sidecars = replicas_from_slices(replica_slices, section.sidecar_port_name)
    staying = sorted((set(replicas) & set(sidecars)) - {pod})
    routers = replicas_from_slices(slices(section.routers_service), section.routers_port_name)
    return Neighbours(pod not in replicas, {name: replicas[name] for name in staying},
                      {name: sidecars[name] for name in staying}, sorted(routers.values()))


def same_identity(seen: Neighbours, identities: Mapping[str, slotfiles.Identity | None],
                  identity: slotfiles.Identity) -> Neighbours:
    """The neighbours whose replica may restore what this one saves: a receiver of another model
    would refuse each file, and the conversations planned for it would not move at all."""
    keep = sorted(name for name in seen.replicas if identities.get(name) == identity)
    return Neighbours(seen.leaving, {name: seen.replicas[name] for name in keep},
                      {name: seen.sidecars[name] for name in keep}, seen.routers)


def ask_identities(sidecars: Mapping[str, str]) -> dict[str, slotfiles.Identity | None]:
    """Each sidecar's identity (name -> host:port), asked at once."""
    with ThreadPoolExecutor(max(1, len(sidecars))) as pool:
        return dict(zip(sidecars, pool.map(identity_of, sidecars.values()), strict=True))


Lookup = Callable[[], Neighbours]


class Drainer:
    """GET /drain: once per pod; a hook delivered twice (the kubelet's are "at least once")
    waits for the first drain and gets its answer. router_token: what the routers' migration
    ports want (sidecar.router_token_file's); replica_key: what the replicas want
    (sidecar.replica_api_key_file's)."""

    def __init__(self, settings: SlotSidecarSettings, pod: Pod, lookup: Lookup,
                 router_token: str | None = None, replica_key: str | None = None) -> None:
        self.settings = settings
        self.pod = pod
        self.lookup = lookup
        self.router_token = router_token
        self.replica_key = replica_key
        self.sidecar = f"{pod.ip}:{settings.sidecar.listen.rpartition(':')[2]}"  # where receivers fetch from
        self._once = threading.Lock()
        self._answer: dict[str, Any] | None = None

    def __call__(self) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + self.settings.migration.drain_seconds
        problems: list[str] = []
        seen = self._wait_leaving(deadline, problems)
        if seen is not None and not seen.leaving:
            return 409, {"refused": f"{self.pod.name} is not terminating: nothing drained"}
        time.sleep(max(0.0, min(self.settings.sidecar.settle_seconds, deadline - time.monotonic())))
        with self._once:
            if self._answer is None:
                self._answer = self._drain(seen, deadline, problems)
            return 200, self._answer

    def _wait_leaving(self, deadline: float, problems: list[str]) -> Neighbours | None:
        """The neighbours once this pod is out of the lists (or at the deadline); None when the API does not answer."""
        while True:
            try:
                seen = self.lookup()
            except Exception as exc:  # the API unreachable or refusing (ApiException, urllib3's errors)
                problems.append(f"kubernetes API: {type(exc).__name__}: {str(exc)[:200]}")
                return None
            if seen.leaving or time.monotonic() + POLL_SECONDS > deadline:
                return seen
            time.sleep(POLL_SECONDS)

    def _drain(self, seen: Neighbours | None, deadline: float, problems: list[str]) -> dict[str, Any]:
        migration = self.settings.migration
        if seen is not None and migration.enabled:
            seen = same_identity(seen, ask_identities(seen.sidecars), self.pod.identity)
        if seen is None or not migration.enabled or not seen.replicas or not seen.routers:
            if seen is not None and migration.enabled:
                problems.append("no replica of its identity, or no router, to hand the caches to")
            if seen is not None:
                problems += tell_drained(seen.routers, self.router_token, self.pod.name)
            self._wait_idle(deadline)
            return {"replica": self.pod.name, "migration": None, "problems": problems}
        source = LlamaServer(self.pod.llama, 5.0, self.replica_key)
        total = migrate_while_draining(source, deadline, lambda saved: self._migrate(seen, deadline, saved),
                                       Outcome(self.pod.name))
        total.problems += tell_drained(seen.routers, self.router_token, self.pod.name)  # before SIGTERM
        self._wait_idle(deadline)
        return {"replica": self.pod.name, "migration": total.as_dict(), "problems": problems}

    def _migrate(self, seen: Neighbours, deadline: float, done: frozenset[tuple[int, int]]) -> Outcome:
        migration, sidecar = self.settings.migration, self.settings.sidecar
        limit = migration.max_disk_mib * 2**20
        return migrate_out(
            (self.pod.name, self.pod.llama), seen.replicas, seen.routers, sidecar.folder, self.pod.identity,
            Sidecars(self.sidecar, seen.sidecars),
            Costs(sidecar.kv_bytes_per_token, migration.prefill_ms_per_token / 1000,
                  migration.transfer_mib_per_second * 2**20),
            Limits(migration.min_tokens, limit, migration.max_age_seconds, limit), deadline,
            progress=lambda line: print(line, flush=True), done=done, router_token=self.router_token,
            replica_key=self.replica_key)

    def _wait_idle(self, deadline: float) -> None:
        """Until no slot of this replica is processing a request (or the deadline)."""
        server = LlamaServer(self.pod.llama, 5.0, self.replica_key)
        while time.monotonic() < deadline:
            try:
                if not any(slot.processing for slot in server.slots()):
                    return
            except SlotError:  # llama-server gone: nothing left to wait for
                return
            time.sleep(POLL_SECONDS)


def serve(settings: SlotSidecarSettings, pod: Pod, lookup: Lookup,
          router_token: str | None = None, replica_key: str | None = None) -> ThreadingHTTPServer:
    """The sidecar's HTTP server for this pod, on sidecar.listen (not yet serving)."""
    sidecar = settings.sidecar
    host, _, port = sidecar.listen.rpartition(":")
    limit = settings.migration.max_disk_mib * 2**20
    files = SidecarSettings(sidecar.folder, pod.identity, limit, settings.migration.max_age_seconds)
    drainer = Drainer(settings, pod, lookup, router_token, replica_key)
    server = make_server((host, int(port)), files, drainer)
    drainer.sidecar = f"{pod.ip}:{server.server_address[1]}"  # port 0: the one bound
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="slots.toml (k8s/15-slot-sidecar-config.yaml)")
    args = parser.parse_args(argv)
    try:
        settings = load_sidecar_settings(args.config, os.environ)
        if not settings.sidecar.folder.is_dir():
            raise SettingsError(f"{args.config}: sidecar.folder {settings.sidecar.folder} is not a folder")
        pod = pod_from_environment(os.environ, settings.sidecar.model_folder)
        router_token = read_secret_file("sidecar.router_token_file", settings.sidecar.router_token_file)
        replica_key = read_secret_file("sidecar.replica_api_key_file", settings.sidecar.replica_api_key_file)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    from extproc.discovery.watch import default_api_client

    api: list[Any] = []  # made at the first drain: a sidecar starts without the API

    def lookup() -> Neighbours:
        if not api:
            api.append(default_api_client())
        return neighbours(api[0], settings, pod.name)

    server = serve(settings, pod, lookup, router_token, replica_key)
    print(f"slot sidecar of {pod.name} on {settings.sidecar.listen} for {settings.sidecar.folder} "
          f"({pod.identity.tag})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
