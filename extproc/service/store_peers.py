"""The other routers on the shared store (store.py): their ids, as the batches of writes read
them, and the streams they publish that this router learns from: their answers' timings (replica
speeds) and their changes to the prefix index (store_index.py)."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.typing import KeyT, StreamIdT

from extproc.routing.prefix_index import IndexChange
from extproc.routing.speeds import AnswerTimings
from extproc.service.metrics import Metrics
from extproc.service.store_index import INDEX_READ, IndexReader, Limits
from extproc.service.store_layout import MAX_NAME_CHARS, EntryChecks, Keys, name

MAX_ROUTERS = 64  # peers read per decision: a set flooded with ids cannot make a read unbounded
ANSWERS_READ = 100  # stream entries read per batch of writes (a new router catches up over a few)


class Peers:
    def __init__(
        self,
        keys: Keys,
        router_id: str,
        checks: EntryChecks,
        metrics: Metrics,
        on_answer: Callable[[str, AnswerTimings], None],
        on_index: Callable[[list[IndexChange]], None],
    ) -> None:
        self.keys = keys
        self.router_id = router_id
        self.checks = checks
        self.metrics = metrics
        self.on_answer = on_answer  # another router's answer: learn the replica's speed from it
        self.on_index = on_index  # another router's changes to the index: make them here
        self.ids: tuple[bytes, ...] = ()  # the other routers' ids the last read found
        self._own = router_id.encode()
        self._answers_seen = b"0-0"  # the last stream entry read: from the oldest kept at the start
        self._index = IndexReader(Limits(checks.bounds.max_request_tokens, MAX_NAME_CHARS))

    async def read_ids(self, client: aioredis.Redis) -> list[bytes]:
        """The routers' ids, read at once (a connection's first call)."""
        return await client.execute_command("SRANDMEMBER", self.keys.routers, MAX_ROUTERS)  # type: ignore[no-any-return]

    def restart(self, members: list[bytes]) -> None:
        """A (re)connection read ``members``: the index's streams are read again from their start."""
        self.found(members)
        self._index.restart()

    def found(self, members: list[bytes]) -> None:
        self.ids = tuple(router for router in members if router != self._own)

    def gone(self, routers: list[bytes]) -> None:
        """Routers whose load key is gone leave the ids until a batch of writes meets them again."""
        self.ids = tuple(router for router in self.ids if router not in routers)

    def queue_reads(self, pipe: Pipeline, routers: tuple[bytes, ...]) -> None:
        """Queue, first in a batch of writes (what came before ours): the answers' stream, the
        routers' ids (the decisions read the loads of these) and ``routers``' changes to the index
        (an idle router keeps up too). ``take_reads`` takes the replies."""
        pipe.xread({self.keys.answers: self._answers_seen}, count=ANSWERS_READ)
        pipe.srandmember(self.keys.routers, MAX_ROUTERS)
        self.queue_index_read(pipe, routers)

    def take_reads(self, results: list[object], routers: tuple[bytes, ...]) -> None:
        self._learn(results[0])
        self.found(results[1])  # type: ignore[arg-type]
        if routers:
            self.take_index(results[2])

    def queue_index_read(self, pipe: Pipeline, routers: tuple[bytes, ...]) -> None:
        """Queue the read of ``routers``' new changes to the prefix index (none: nothing queued)."""
        if routers:
            streams: dict[KeyT, StreamIdT] = dict(self._index.streams(self.keys.index_prefix, routers).items())
            pipe.xread(streams, count=INDEX_READ)

    def take_index(self, reply: object) -> None:
        """The other routers' changes read, each entry checked, made in this router's index."""
        changes, invalid, missed = self._index.take(self.keys.index_prefix, reply)
        self.metrics.store_invalid["index"] += invalid
        self.metrics.store_index_missed += missed
        if changes:
            self.metrics.store_index_applied += len(changes)
            self.on_index(changes)

    def _learn(self, reply: object) -> None:
        """The other routers' answers read from the stream, each checked: an entry that does not
        parse or is out of bounds is skipped and counted, the rest learnt in order."""
        entries = reply[0][1] if isinstance(reply, list) and reply and isinstance(reply[0], list | tuple) else []
        for entry_id, fields in entries:
            self._answers_seen = entry_id
            try:
                router = name(fields[b"router"])
                answers = [] if router == self.router_id else self.checks.answers(fields[b"answers"])
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                self.metrics.store_invalid["answers"] += 1
                continue
            for replica, timings in answers:
                self.on_answer(replica, timings)
            self.metrics.store_answers_learnt += len(answers)
