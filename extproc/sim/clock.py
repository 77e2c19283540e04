"""The two-phase clock both simulated engines run on (replica.py's llama.cpp server, paged.py's
paged-KV GPU server).

A request runs in two phases, prefill then decode, each a fixed amount of "solo" work from
the cost model. The requests sharing a phase all progress at one rate, so each phase keeps
one clock (solo seconds a request in that phase has done since the start) and each request
the clock value at which its phase ends: advancing time is O(1), and the engine needs one
pending wake-up per replica, not one event per token. For the same reason the requests of a
phase end in the order of those clock values: each phase keeps its requests sorted by them,
so the next phase change is read off the front of two lists. How many requests share each
phase's pace (and how much slower the host makes it) is the engine's: ``sharing()``.
"""

from __future__ import annotations

from bisect import bisect_right

from extproc.sim.costmodel import CostModel
from extproc.sim.request import Request

DONE_EPSILON = 1e-7  # solo seconds below which a phase counts as finished (float rounding of the clocks)


class TwoPhaseClock:
    __slots__ = ("cost", "running", "started", "prefilling", "prefill_targets", "decoding", "decode_targets",
                 "prefill_clock", "decode_clock", "updated_at", "prefill_slowdown", "decode_slowdown", "host_factor")

    def __init__(self, cost: CostModel, slots: int) -> None:
        self.cost = cost
        self.running = 0  # requests started and not finished
        self.started = 0  # requests ever started (orders them)
        # running requests per phase, sorted by target (the order their phase ends), and their targets
        self.prefilling: list[Request] = []
        self.prefill_targets: list[float] = []
        self.decoding: list[Request] = []
        self.decode_targets: list[float] = []
        self.prefill_clock = 0.0
        self.decode_clock = 0.0
        self.updated_at = 0.0
        self.prefill_slowdown, self.decode_slowdown = cost.slowdowns(slots)
        self.host_factor = 1.0  # >1 when busy replicas want more CPU threads than the host has

    def sharing(self) -> tuple[int, int, float]:
        """(requests sharing the prefill pace, the decode pace, the host's slowdown factor)."""
        raise NotImplementedError

    def advance(self, now: float) -> None:
        """Move the phase clocks up to ``now`` at the current sharing rate (a phase that no
        request shares stands still)."""
        if now > self.updated_at:
            prefill_sharing, decode_sharing, slower = self.sharing()
            elapsed = (now - self.updated_at) / slower
            if prefill_sharing:
                self.prefill_clock += elapsed / self.prefill_slowdown[prefill_sharing]
            if decode_sharing:
                self.decode_clock += elapsed / self.decode_slowdown[decode_sharing]
        self.updated_at = now

    def next_change(self) -> float | None:
        """Seconds from ``updated_at`` until the next request ends a phase (None when idle)."""
        prefill_sharing, decode_sharing, slower = self.sharing()
        wait = None
        if self.decode_targets:
            wait = (self.decode_targets[0] - self.decode_clock) * (self.decode_slowdown[decode_sharing] * slower)
        if self.prefill_targets:
            prefill_wait = ((self.prefill_targets[0] - self.prefill_clock)
                            * (self.prefill_slowdown[prefill_sharing] * slower))
            if wait is None or prefill_wait <= wait:
                return prefill_wait
        return wait

    def start_prefill(self, request: Request, hit: int, now: float) -> None:
        """The request starts at ``now`` with ``hit`` prompt tokens found cached: its prefill phase begins."""
        prompt = request.prompt_tokens
        cached = min(hit, prompt - 1)  # the last prompt token is always evaluated
        request.cache_n = cached
        request.prompt_n = prompt - cached
        request.started_at = now
        request.order = self.started
        self.started += 1
        self.running += 1
        request.target = target = self.prefill_clock + self.cost.prefill_s(prompt - cached, cached)
        index = bisect_right(self.prefill_targets, target)  # the phase's lists stay sorted by target
        self.prefill_targets.insert(index, target)
        self.prefilling.insert(index, request)

    def end_phases(self, now: float) -> list[Request]:
        """Advance to ``now``: prefills that ran out start decoding (their first token now);
        returns the requests whose decode ran out, in the order they were started (the
        engine frees what they held and counts them out of ``running``)."""
        self.advance(now)
        prefill_targets, decode_targets = self.prefill_targets, self.decode_targets
        while prefill_targets and prefill_targets[0] - self.prefill_clock <= DONE_EPSILON:
            del prefill_targets[0]
            request = self.prefilling.pop(0)
            request.first_token_at = now
            request.target = target = self.decode_clock + self.cost.decode_s(request.max_tokens, request.prompt_tokens)
            index = bisect_right(decode_targets, target)  # the phase's lists stay sorted by target
            decode_targets.insert(index, target)
            self.decoding.insert(index, request)
        finished = []
        while decode_targets and decode_targets[0] - self.decode_clock <= DONE_EPSILON:
            del decode_targets[0]
            finished.append(self.decoding.pop(0))
        if len(finished) > 1:
            finished.sort(key=_start_order)
        return finished


def _start_order(request: Request) -> int:
    return request.order
