"""The slot sidecar: beside each llama.cpp replica that has a slot folder of its own (a
Kubernetes pod's volume), it serves that folder's slot files to its peers and fetches one
from a peer when a migration hands it a conversation.

    GET  /slots/<name>                    a slot file or its manifest, from this folder
    GET  /identity                        what this replica's slot files are for (slotfiles.Identity):
         a leaving replica hands its caches only to replicas of its own identity
    POST /fetch  {"peer": "host:port", "conversation_key": N}
         -> 200 {"file": name, "tokens": n, "bytes": b} | 404 {"miss": why}
    GET  /drain                           (a Kubernetes pod's, drain_k8s.py: the llama.cpp
         container's preStop hook, from the pod's loopback only) drain this replica and move
         its caches out; answers when done

A fetch asks the peer for the file named with *this* replica's identity (slotfiles.stem), so
a slot of another model, context or KV type is simply not found; the manifest is checked
again, and the file's tokens against it, before the file is renamed into place. The folder is
pruned after every fetch. Nothing is written but slot files and their manifests.

    python -m extproc.migration.sidecar --folder DIR --listen HOST:PORT --model-sha256 HEX
        --slot-context N --cache-type f16 --max-disk-mib M --max-age-seconds S
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from extproc.migration import slotfiles

NAME = re.compile(r"^[0-9a-f]{16}-[0-9]+-[a-z0-9_]+-[0-9a-f]{16}\.(bin|json)$")
MAX_REQUEST_BYTES = 4096
LOOPBACK = ("127.0.0.1", "::1")
CHUNK = 1 << 20


@dataclass(frozen=True)
class SidecarSettings:
    folder: Path
    identity: slotfiles.Identity
    max_bytes: int
    max_age_seconds: float
    timeout: float = 30.0


Drain = Callable[[], tuple[int, dict[str, Any]]]


def make_server(listen: tuple[str, int], settings: SidecarSettings, drain: Drain | None = None) -> ThreadingHTTPServer:
    """drain: what GET /drain runs (drain_k8s.Drainer); without it /drain is not served."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/drain" and drain is not None:
                if self.client_address[0] not in LOOPBACK:  # a peer may fetch files, never drain this pod
                    self._json(403, {"error": "only this pod's own preStop hook (on loopback) may drain it"})
                    return
                self._json(*drain())
                return
            if self.path == "/identity":
                self._json(200, asdict(settings.identity))
                return
            name = self.path.removeprefix("/slots/")
            path = settings.folder / name
            if not self.path.startswith("/slots/") or not NAME.match(name) or not path.is_file():
                self._json(404, {"miss": f"no {name}"})
                return
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(path.stat().st_size))
            self.end_headers()
            with open(path, "rb") as handle:
                while chunk := handle.read(CHUNK):
                    self.wfile.write(chunk)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("content-length") or 0)
            if self.path != "/fetch" or not 0 < length <= MAX_REQUEST_BYTES:
                self._json(400, {"error": "POST /fetch with a JSON body"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                peer, key = str(body["peer"]), int(body["conversation_key"])
            except (ValueError, KeyError, TypeError):
                self._json(400, {"error": "the body must be {\"peer\": \"host:port\", \"conversation_key\": N}"})
                return
            status, answer = fetch(settings, peer, key)
            self._json(status, answer)

        def _json(self, status: int, answer: dict[str, Any]) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # one line a request is noise here
            return

    return ThreadingHTTPServer(listen, Handler)


def fetch(settings: SidecarSettings, peer: str, key: int) -> tuple[int, dict[str, Any]]:
    stem = slotfiles.stem(settings.identity, key)
    folder = settings.folder
    try:
        with urllib.request.urlopen(f"http://{peer}/slots/{stem}.json", timeout=settings.timeout) as reply:
            (folder / f"{stem}.json.part").write_bytes(reply.read(MAX_REQUEST_BYTES))
        manifest = slotfiles.read_manifest(folder / f"{stem}.json.part")
        if manifest is None or manifest.identity != settings.identity or manifest.conversation_key != key:
            return 404, {"miss": "the peer's manifest is not for this replica's identity"}
        size = 0
        with urllib.request.urlopen(f"http://{peer}/slots/{stem}.bin", timeout=settings.timeout) as reply, \
                open(folder / f"{stem}.bin.part", "wb") as out:
            while chunk := reply.read(CHUNK):
                size += len(chunk)
                if size > settings.max_bytes:
                    return 404, {"miss": f"over the folder's bound of {settings.max_bytes} bytes"}
                out.write(chunk)
        tokens = slotfiles.read_tokens(folder / f"{stem}.bin.part")
        if tokens is None or len(tokens) != manifest.tokens:
            return 404, {"miss": "the file does not hold the manifest's tokens"}
        os.replace(folder / f"{stem}.bin.part", folder / f"{stem}.bin")
        os.replace(folder / f"{stem}.json.part", folder / f"{stem}.json")
    except urllib.error.HTTPError as exc:
        return 404, {"miss": f"the peer answered {exc.code}"}
    except OSError as exc:
        return 404, {"miss": f"the peer did not answer: {exc}"}
    finally:
        for part in folder.glob(f"{stem}.*.part"):
            part.unlink(missing_ok=True)
    slotfiles.prune(folder, settings.max_bytes, settings.max_age_seconds)
    return 200, {"file": f"{stem}.bin", "tokens": manifest.tokens, "bytes": size}


def identity_of(sidecar: str, timeout: float = 5.0) -> slotfiles.Identity | None:
    """The identity the sidecar at ``sidecar`` (host:port) serves; None when it does not say."""
    try:
        with urllib.request.urlopen(f"http://{sidecar}/identity", timeout=timeout) as reply:
            return slotfiles.Identity(**json.loads(reply.read(MAX_REQUEST_BYTES)))
    except (OSError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Sidecars:
    """A migration's transport when each replica has its own folder: the receiver's sidecar
    fetches the file from the leaving replica's."""

    leaving: str  # the leaving replica's sidecar, host:port
    receivers: dict[str, str]  # replica name -> its sidecar, host:port
    timeout: float = 60.0

    def deliver(self, receiver: str, conversation_key: int) -> tuple[str, int] | None:
        body = json.dumps({"peer": self.leaving, "conversation_key": conversation_key}).encode()
        request = urllib.request.Request(f"http://{self.receivers[receiver]}/fetch", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                answer = json.loads(reply.read())
        except (OSError, ValueError):  # a 404 (a miss) is an HTTPError, an OSError
            return None
        return str(answer["file"]), int(answer["tokens"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="the replica's --slot-save-path")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--model-sha256", required=True)
    parser.add_argument("--slot-context", type=int, required=True)
    parser.add_argument("--cache-type", required=True)
    parser.add_argument("--max-disk-mib", type=int, required=True)
    parser.add_argument("--max-age-seconds", type=float, required=True)
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if not args.folder.is_dir() or not port.isdigit():
        print(f"slot sidecar: --folder {args.folder} must be a folder and --listen HOST:PORT "
              f"(got {args.listen!r})", file=sys.stderr)
        return 2
    identity = slotfiles.Identity(args.model_sha256, args.slot_context, args.cache_type)
    settings = SidecarSettings(args.folder, identity, args.max_disk_mib * 2**20, args.max_age_seconds)
    server = make_server((host, int(port)), settings)
    print(f"slot sidecar on {args.listen} for {args.folder} ({identity.tag})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
