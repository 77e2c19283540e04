"""The list/watch loop every Kubernetes discovery source runs (official client, one daemon
thread a loop), and what they share: credentials, timing, the hand-over to asyncio.

The ``kubernetes`` client is synchronous, so each list/watch loop runs in a daemon thread
(EndpointSlices, kubernetes.py, run one; InferencePool discovery, inference_pool.py, runs two
on one ApiClient, whose connection pool is thread-safe); it hands each new full snapshot to the
asyncio side, which yields it from ``snapshots()``. The grpc.aio loop never blocks on the API.

Loop: list (full state, resourceVersion) → watch from that version, again and again,
resuming from the last version seen (events and bookmarks) → on 410 Gone relist at
once; on any other failure (API unreachable, 401/403, 5xx) keep the last known set,
wait with exponential backoff and relist.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from pydantic import Field

from extproc.discovery import Snapshot, leaving_of
from extproc.discovery.plugin import SharedKeys
from extproc.strict import Strict

log = structlog.get_logger("extproc.discovery.watch")

HTTP_GONE = 410
# Server-side length of one watch request; the stream then ends and is resumed from the
# last resourceVersion. Kept well under the API server's own limit (~30-60 min).
WATCH_TIMEOUT_SECONDS = 300
# The backoff doubles from the section's backoff_seconds up to this ceiling.
MAX_BACKOFF_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0
LIST_TIMEOUT_SECONDS = 30.0


class KubernetesCredentialsError(RuntimeError):
    """No usable credentials: nothing to retry, the service should stop and say why."""


def credentials() -> client.ApiClient:
    try:
        return default_api_client()
    except Exception as exc:
        raise KubernetesCredentialsError(
            f"discovery from the Kubernetes API but no usable credentials ({type(exc).__name__}: {exc}); "
            "in a pod the ServiceAccount token is used, elsewhere KUBECONFIG or ~/.kube/config"
        ) from exc


def default_api_client() -> client.ApiClient:
    """In-cluster credentials in a pod; elsewhere the kubeconfig (KUBECONFIG, ~/.kube/config)."""
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:  # KUBECONFIG is read here, not at import time as the client's default does
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.ApiClient(configuration)


class WatchSettings(Strict):
    """The keys of every API-watching source's section ([discovery.kubernetes], [discovery.inference-pool])."""

    namespace: str = Field(description="the namespace watched")
    backoff_seconds: float = Field(gt=0, description="first retry delay when the API is unreachable or refuses "
                                                     "(doubles, capped)")


@dataclass(frozen=True)
class WatchTiming:
    backoff_seconds: float
    max_backoff_seconds: float
    watch_timeout_seconds: int


def watch_timing(section: WatchSettings, watch_timeout_seconds: int, max_backoff_seconds: float) -> WatchTiming:
    return WatchTiming(
        backoff_seconds=section.backoff_seconds,
        max_backoff_seconds=max(max_backoff_seconds, section.backoff_seconds),
        watch_timeout_seconds=watch_timeout_seconds,
    )


Publish = Callable[[dict[str, str]], None]


async def threaded_snapshots(
    api_client: client.ApiClient | None, start_loops: Callable[[client.ApiClient, Publish], list[ListWatchLoop]]
) -> AsyncIterator[dict[str, str]]:
    """The Discovery protocol over blocking list/watch loops, one daemon thread each.

    ``start_loops`` builds the loops on an ApiClient (``api_client``, else one from
    ``credentials()``, closed at the end) and a thread-safe ``publish``; every published
    snapshot that differs from the last one yielded is yielded. The loops stop when the
    iteration is closed or cancelled.
    """
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    latest: list[dict[str, str]] = [{}]  # one slot, written on the loop thread only

    def deliver(snapshot: dict[str, str]) -> None:
        latest[0] = snapshot
        changed.set()

    def publish(snapshot: dict[str, str]) -> None:  # called from the watch threads
        with contextlib.suppress(RuntimeError):  # the loop closed as a thread finished
            loop.call_soon_threadsafe(deliver, snapshot)

    owned = api_client is None
    api = await asyncio.to_thread(credentials) if api_client is None else api_client
    workers = start_loops(api, publish)
    threads = [threading.Thread(target=w.run, name="k8s-discovery", daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    last: dict[str, str] | None = None
    try:
        while True:
            await changed.wait()
            changed.clear()
            if latest[0] != last:
                last = latest[0]
                yield Snapshot(last, leaving_of(last))
    finally:
        for worker in workers:
            worker.stopped.set()  # all stop at once, then each is joined
        for worker, thread in zip(workers, threads, strict=True):
            await asyncio.to_thread(worker.stop_and_join, thread, CONNECT_TIMEOUT_SECONDS)
        if owned:
            api.close()


class WatchedSource:
    """What every API-watching discovery shares: the namespace, the watch timing, the client.

    ``api_client`` is for tests and tools; by default the credentials come from
    ``default_api_client()``. Each ``snapshots()`` iteration runs its own watch threads,
    stopped when the iteration is closed or cancelled.
    """

    def __init__(
        self,
        section: WatchSettings,
        shared: SharedKeys,
        api_client: client.ApiClient | None = None,
        *,
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
        max_backoff_seconds: float = MAX_BACKOFF_SECONDS,
    ) -> None:
        self.namespace = section.namespace
        self.keep_leaving = shared.leaving_seconds > 0
        self.timing = watch_timing(section, watch_timeout_seconds, max_backoff_seconds)
        self._api_client = api_client


class ListWatchLoop:
    """The blocking list/watch loop of one resource; runs in its own thread.

    List (full state, resourceVersion) → watch from that version, again and again,
    resuming from the last version seen (events and bookmarks) → on 410 Gone relist at
    once; on any other failure keep what is known, back off and relist. A relist replaces
    the whole state, so a dropped watch neither loses nor duplicates an object.
    Subclasses name the list call and say what the list and each event change.
    """

    resource = ""  # names the log events

    def __init__(self, timing: WatchTiming) -> None:
        self._timing = timing
        self.stopped = threading.Event()
        self._watch: watch.Watch | None = None

    def list_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The list function, its positional arguments and its selectors."""
        raise NotImplementedError

    def replace(self, items: list[Any]) -> None:
        """A list's full state."""
        raise NotImplementedError

    def apply(self, kind: str, obj: Any) -> None:
        """One ADDED, MODIFIED or DELETED event."""
        raise NotImplementedError

    def serving(self) -> list[str]:
        """The replicas in service, for the failure log lines."""
        raise NotImplementedError

    def stop_and_join(self, thread: threading.Thread, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.stopped.set()
        while thread.is_alive() and time.monotonic() < deadline:
            # Shuts the watch socket down, unblocking a read in progress. Repeated: a watch
            # whose response headers have not arrived yet has no socket to shut down.
            current = self._watch
            if current is not None:
                current.stop()
            thread.join(0.05)

    def run(self) -> None:
        backoff = self._timing.backoff_seconds
        while not self.stopped.is_set():
            try:
                version = self._list()
                backoff = self._timing.backoff_seconds
                while not self.stopped.is_set():
                    version = self._watch_once(version)
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info(f"{self.resource}_watch_expired", action="relist")
                    continue
                log.warning(
                    "kubernetes_api_error",
                    resource=self.resource,
                    status=exc.status,
                    reason=str(exc.reason),
                    retry_in_s=backoff,
                    serving=self.serving(),
                )
            except Exception as exc:  # unreachable, reset, timed out, malformed reply
                if self.stopped.is_set():
                    break
                log.warning(
                    "kubernetes_api_unreachable",
                    resource=self.resource,
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in_s=backoff,
                    serving=self.serving(),
                )
            self.stopped.wait(backoff)
            backoff = min(backoff * 2, self._timing.max_backoff_seconds)

    def _list(self) -> str:
        function, args, selectors = self.list_call()
        result = function(*args, **selectors, _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS))
        if isinstance(result, dict):  # custom objects come as plain JSON
            items, version = result.get("items") or [], (result.get("metadata") or {}).get("resourceVersion")
        else:
            items, version = result.items or [], result.metadata and result.metadata.resource_version
        self.replace(list(items))
        if not version:
            raise ValueError(f"{self.resource} list without a resourceVersion: cannot watch from it")
        return str(version)

    def _watch_once(self, version: str) -> str:
        """One watch request; returns the version to resume from (events and bookmarks)."""
        function, args, selectors = self.list_call()
        timeout = self._timing.watch_timeout_seconds
        self._watch = current = watch.Watch()
        try:
            for event in current.stream(
                function,
                *args,
                **selectors,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                # the client gives up one timeout later: a silently dead connection ends too
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, timeout + CONNECT_TIMEOUT_SECONDS),
            ):
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    self.apply(event["type"], event["object"])
        finally:
            self._watch = None
        return str(current.resource_version or version)


def log_change(previous: dict[str, str], snapshot: dict[str, str], **source: str) -> None:
    log.info(
        "replicas_changed",
        replicas=sorted(snapshot),
        added=sorted(set(snapshot) - set(previous)),
        removed=sorted(set(previous) - set(snapshot)),
        leaving=sorted(leaving_of(snapshot)),
        endpoints=dict(snapshot),
        **source,
    )
