"""Large request bodies are parsed in a worker process, so that they cannot stall the others.

The service is one event loop; orjson holds the GIL while it parses, so a 4 MiB body of many
small messages blocked every other request for its whole parse (measured: 110,000 messages,
60-200 ms each on a busy 2-core machine; 24 such bodies at once raised other clients' p50 six
times). Bodies of at least OFFLOAD_BYTES go to one worker process instead: the loop goes on
deciding the small ones, and the objects of a huge parse live and die in the worker (which is
replaced every WORKER_TASKS bodies: its memory returns to the system). At most MAX_WAITING
large bodies wait for it; more are refused with 503 at once rather than held past Envoy's
ext_proc timeout (which would fail open). The worker counts tokens with the service's own
counter, sent to it once when it starts (a GGUF tokenizer travels as its encoder's JSON).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from extproc.routing.tokens import TokenCounter
from extproc.service.bodies import CHAT_PATHS, BadRequest, BodyLimits, ParsedRequest, parse_request, too_many_messages

OFFLOAD_BYTES = 256 << 10  # below: parsed inline (well under a millisecond for ordinary chats)
MAX_WAITING = 8
WORKER_TASKS = 64


_worker_counter: TokenCounter | None = None  # in the worker: the service's counter


def _start_worker(counter: TokenCounter | None) -> None:
    global _worker_counter
    _worker_counter = counter


def parse_or_refusal(
    path: str, content_type: str, body: bytes, limits: BodyLimits, block_chars: int, session_fields: tuple[str, ...]
) -> ParsedRequest | BadRequest:
    """parse_request's result or its refusal, as a value (it crosses a process boundary)."""
    try:
        return parse_request(path, content_type, body, limits, block_chars, counter=_worker_counter,
                             session_fields=session_fields)
    except BadRequest as exc:
        return exc


class BodyParser:
    def __init__(self, limits: BodyLimits, counter: TokenCounter | None = None) -> None:
        self.limits = limits
        self.waiting = 0
        # spawn: a forked copy of a process running gRPC's threads is not safe
        self.pool = ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=WORKER_TASKS,
            initializer=_start_worker, initargs=(counter,),
        )

    def takes(self, body: bytes) -> bool:
        return len(body) >= OFFLOAD_BYTES

    async def parse(
        self, path: str, content_type: str, body: bytes, block_chars: int = 0, session_fields: tuple[str, ...] = ()
    ) -> ParsedRequest | BadRequest:
        refusal = too_many_messages(body, self.limits) if path in CHAT_PATHS else None
        if refusal is not None:
            return refusal
        if self.waiting >= MAX_WAITING:
            return BadRequest(503, f"too many large bodies in progress (over {MAX_WAITING}): retry shortly")
        self.waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self.pool, parse_or_refusal, path, content_type, body, self.limits, block_chars, session_fields
            )
        finally:
            self.waiting -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
