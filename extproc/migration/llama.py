"""The few llama.cpp server endpoints a migration uses (the server must run with --slot-save-path).

Every call carries the replicas' API key (their --api-key-file): llama.cpp answers 401
without it (docs/security.md#the-replicas-api-key)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class SlotError(RuntimeError):
    """A replica refused or failed a slot action; the message says which and why."""


@dataclass(frozen=True)
class Slot:
    id: int
    tokens: int  # tokens held (0: empty)
    processing: bool
    last_task: int  # the id of the last task it ran (-1: none): a larger one was used later


def key_headers(key: str | None) -> dict[str, str]:
    """What a request straight to a replica carries: its API key (nothing without one)."""
    return {"authorization": f"Bearer {key}"} if key else {}


class LlamaServer:
    def __init__(self, address: str, timeout: float = 30.0, key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.key = key

    def slots(self) -> list[Slot]:
        return [Slot(int(s["id"]), int(s.get("n_prompt_tokens") or 0), bool(s.get("is_processing")),
                     int(s.get("id_task", -1))) for s in self._call("GET", "/slots")]

    def save(self, slot: int, filename: str) -> dict[str, Any]:
        """{"n_saved": tokens, "n_written": bytes, ...}"""
        return dict(self._call("POST", f"/slots/{slot}?action=save", {"filename": filename}))

    def restore(self, slot: int, filename: str) -> dict[str, Any]:
        """{"n_restored": tokens, "n_read": bytes, ...}"""
        return dict(self._call("POST", f"/slots/{slot}?action=restore", {"filename": filename}))

    def erase(self, slot: int) -> None:
        """Empty the slot's KV cache."""
        self._call("POST", f"/slots/{slot}?action=erase")

    def held(self, tokens: list[int]) -> tuple[int, int]:
        """(the slot that ran them, how many of `tokens` were cached): runs them as the next turn
        would, generating nothing (llama.cpp computes the last one again), on the slot llama.cpp
        picks, not pinned with `id_slot`: a request pinned to a slot that is empty skips the host-RAM
        prompt cache (ggml-org/llama.cpp #28139), and so would report a cache the next turn finds.
        The slot then lists its tokens and counts as used, so neither a later restore nor
        llama.cpp's least-recently-used choice takes it first."""
        reply = self._call("POST", "/completion", {"prompt": tokens, "n_predict": 0, "cache_prompt": True})
        return int(reply["id_slot"]), int(reply["timings"]["cache_n"])

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._call("POST", "/detokenize", {"tokens": tokens})["content"])

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt the server's chat template makes of `messages`."""
        return str(self._call("POST", "/apply-template", {"messages": messages})["prompt"])

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.address}{path}", data=data, method=method,
                                         headers={"content-type": "application/json", **key_headers(self.key)})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise SlotError(f"{self.address} {method} {path}: HTTP {exc.code} {detail}") from None
        except (OSError, ValueError) as exc:
            raise SlotError(f"{self.address} {method} {path}: {exc}") from None
