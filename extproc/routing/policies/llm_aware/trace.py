"""llm-aware's trace: the numbers of one decision, and how an operator reads them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from extproc.routing.decision import Candidate, Check, Decision, Trace
from extproc.routing.render import check_line, headline, num, peer_lines


class LlmAwareTrace(NamedTuple):
    """llm-aware's numbers: where it preferred and why, the request's cost there, the loads and
    caps of the bounded walk, the prefix index's view and the predicted first tokens."""

    unit: str  # "tokens": llm-aware bounds loads in tokens
    home: str  # the conversation's ring home
    preferred: str
    preferred_by: str  # "ring" | "memory" | "prefix" | "lru"
    remembered: str | None  # placement memory: the conversation's last replica ...
    remembered_tokens: int | None  # ... and the prompt size served there
    cached_tokens: int  # predicted cached prefix on the preferred replica
    preferred_cost: int  # the request's cost there: new tokens only where cached
    loads: Mapping[str, int]  # the eligible replicas' loads at the decision (a copy)
    total: int  # with this request's cost on the preferred replica
    average: float
    cap: float  # (1 + epsilon) x average
    long_cap: float | None  # long stickiness: the cached replica's limit instead of the cap
    long_threshold: int | None  # prompt tokens from which a conversation counts as long
    checks: tuple[Check, ...]  # the bounded walk (empty when the prediction decided)
    prompt_blocks: int | None  # the prefix index: the prompt's blocks ...
    candidates: tuple[Candidate, ...]  # ... the holders it entered, deepest first ...
    figures: tuple[tuple[str, float], ...]  # ... and its figures (capacity, holders, the cap in requests)
    predicted_ttft_s: tuple[tuple[str, float], ...]  # (replica, predicted seconds to the first token) weighed

    def render(self, decision: Decision) -> list[str]:
        trace = decision.trace
        lines = [headline(decision), _preference_line(trace, self), _cost_line(trace, self)]
        loads = " ".join(f"{name}={load}" for name, load in self.loads.items())
        lines.append(f"  load ({self.unit}): {loads}; +{self.preferred_cost} → total={self.total}, "
                     f"avg={num(self.average)}, cap={num(self.cap)}")
        if self.long_cap is not None:
            lines.append(
                f"  long stickiness: prompt_tokens={trace.prompt_tokens} ≥ {self.long_threshold} and "
                f"cache_likely=True → long_cap={num(self.long_cap)}"
            )
        lines.extend(check_line(check, decision.reason, self.cap, self.figures) for check in self.checks)
        if self.predicted_ttft_s:
            weighed = " ".join(f"{name}={seconds:.3f} s" for name, seconds in self.predicted_ttft_s)
            lines.append(f"  predicted first token: {weighed} → {decision.reason}")
        if decision.reason == "kept":
            lines.append(_kept_line(decision, self))
        if self.prompt_blocks is not None:
            lines.extend(peer_lines(decision, self.prompt_blocks, self.loads, self.cap, self.figures,
                                    self.candidates))
        return lines


def _preference_line(trace: Trace, details: LlmAwareTrace) -> str:
    if details.remembered is not None:
        memory = f"last served on {details.remembered} with {details.remembered_tokens} prompt tokens"
    else:
        memory = "nothing remembered"
    preferred = details.preferred
    if details.preferred_by == "memory":
        return f"  placement memory: {memory} → preferred={preferred}"
    if details.preferred_by == "prefix":
        return (f"  prefix index: {preferred} holds the longest prefix ({details.cached_tokens} of "
                f"{trace.prompt_tokens} tokens; ring home {details.home}) → preferred={preferred}")
    if details.preferred_by == "lru":
        use = dict(details.figures).get("least_recent_use")
        oldest = "has room for it" if use is not None and use < 0 else f"least recent prompt is the oldest (use {use})"
        return (f"  prefix index: no replica holds any of the prompt; under the cap {preferred}'s {oldest}"
                f" (ring home {details.home}) → preferred={preferred}")
    return f"  ring home: {details.home} ({memory}) → preferred={preferred}"


def _cost_line(trace: Trace, details: LlmAwareTrace) -> str:
    prompt, cached = trace.prompt_tokens, details.cached_tokens
    if cached:
        return (f"  cost on {details.preferred}: max(1, {prompt}-{cached})={max(1, prompt - cached)} + "
                f"{trace.max_tokens} = {details.preferred_cost} (new tokens only, cache hit)")
    return (f"  cost on {details.preferred}: {prompt} + {trace.max_tokens} = {details.preferred_cost} "
            f"(whole history, no cache)")


def _kept_line(decision: Decision, details: LlmAwareTrace) -> str:
    landing = {check.replica: check.load + check.cost for check in details.checks}
    others = [after for name, after in landing.items() if name != decision.replica]
    factor = details.cap / details.average if details.average else 1.0  # = 1 + ε
    return (f"  none fitted under the cap; {decision.replica} lands at {landing.get(decision.replica)}, "
            f"no other at {factor:.3g}x lower (least {min(others) if others else '-'}): kept, a redirect pays "
            f"the whole prefill again")
