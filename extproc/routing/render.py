"""Decision traces as text, the way an operator reads them (the edge of the core)."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.routing.decision import Candidate, Check, Decision, Trace, detail_fields
from extproc.routing.policies.bounded import BoundedTrace
from extproc.routing.policies.llm_aware import LlmAwareTrace
from extproc.routing.policies.situation import PeerTrace

CANDIDATES_SHOWN = 8
LOWEST_WINS = frozenset({"kv-cost"})  # peer policies whose candidate score is a cost


def render_trace(decision: Decision) -> str:
    trace, details = decision.trace, decision.trace.details
    lines = [f"{_title(trace)} → {decision.replica} ({decision.reason})"]
    if isinstance(details, LlmAwareTrace):
        lines.extend(_llm_aware_lines(decision, details))
    elif isinstance(details, BoundedTrace):
        lines.append(_load_line(details.unit, details.loads, details.total, details.cap))
        lines.extend(_check_line(check, decision.reason) for check in details.checks)
    elif isinstance(details, PeerTrace):
        if details.total is not None and details.cap is not None:  # chwbl's walk
            lines.append(_load_line(details.unit, details.loads, details.total, details.cap))
            lines.extend(_check_line(check, decision.reason) for check in details.checks)
        lines.extend(_peer_lines(decision, details.prompt_blocks, details.loads, details.cap, details.figures,
                                 details.candidates))
    elif details is not None:  # another policy's own NamedTuple
        lines.append("  " + " ".join(f"{name}={value}" for name, value in detail_fields(details).items()))
    return "\n".join(lines)


def _llm_aware_lines(decision: Decision, details: LlmAwareTrace) -> list[str]:
    trace = decision.trace
    lines = [_preference_line(trace, details), _cost_line(trace, details)]
    loads = " ".join(f"{name}={load}" for name, load in details.loads.items())
    lines.append(f"  load ({details.unit}): {loads}; +{details.preferred_cost} → total={details.total}, "
                 f"avg={_num(details.average)}, cap={_num(details.cap)}")
    if details.long_cap is not None:
        lines.append(
            f"  long stickiness: prompt_tokens={trace.prompt_tokens} ≥ {details.long_threshold} and "
            f"cache_likely=True → long_cap={_num(details.long_cap)}"
        )
    lines.extend(_check_line(check, decision.reason, details.cap, details.figures) for check in details.checks)
    if details.predicted_ttft_s:
        weighed = " ".join(f"{name}={seconds:.3f} s" for name, seconds in details.predicted_ttft_s)
        lines.append(f"  predicted first token: {weighed} → {decision.reason}")
    if decision.reason == "kept":
        lines.append(_kept_line(decision, details))
    if details.prompt_blocks is not None:
        lines.extend(_peer_lines(decision, details.prompt_blocks, details.loads, details.cap, details.figures,
                                 details.candidates))
    return lines


def _peer_lines(decision: Decision, prompt_blocks: int, loads: Mapping[str, int], cap: float | None,
                figures: tuple[tuple[str, float], ...], candidates: tuple[Candidate, ...]) -> list[str]:
    trace = decision.trace
    lines = [f"  prompt: {prompt_blocks} blocks; predicted cached on the pick: {decision.predicted_cached_tokens}"
             f" of {trace.prompt_tokens} tokens"]
    if cap is None:  # chwbl and llm-aware show their loads with the cap already
        lines.append("  in flight (requests): " + " ".join(f"{name}={load}" for name, load in loads.items()))
    if figures:
        lines.append("  " + " ".join(f"{name}={value:.3g}" for name, value in figures))
    ranked = sorted(candidates, key=lambda c: c.score, reverse=trace.policy not in LOWEST_WINS)
    lines.extend(_candidate_line(candidate, decision.replica) for candidate in ranked[:CANDIDATES_SHOWN])
    if len(ranked) > CANDIDATES_SHOWN:
        lines.append(f"  … {len(ranked) - CANDIDATES_SHOWN} more candidates")
    return lines


def _candidate_line(candidate: Candidate, chosen: str) -> str:
    mark = " ← pick" if candidate.replica == chosen else ""
    return (f"  {candidate.replica}: matched {candidate.matched_blocks} blocks, load {candidate.load}, "
            f"score {candidate.score:.3f}{mark}")


def _title(trace: Trace) -> str:
    if isinstance(trace.details, BoundedTrace):
        return f"bounded ({trace.details.unit.removesuffix('s')} mode)"
    return trace.policy


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


def _load_line(unit: str, loads: Mapping[str, int], total: int, cap: float) -> str:
    shown = " ".join(f"{name}={load}" for name, load in loads.items())
    return f"  load ({unit}): {shown}; with this request total={total}, cap={_num(cap)}"


def _kept_line(decision: Decision, details: LlmAwareTrace) -> str:
    landing = {check.replica: check.load + check.cost for check in details.checks}
    others = [after for name, after in landing.items() if name != decision.replica]
    factor = details.cap / details.average if details.average else 1.0  # = 1 + ε
    return (f"  none fitted under the cap; {decision.replica} lands at {landing.get(decision.replica)}, "
            f"no other at {factor:.3g}x lower (least {min(others) if others else '-'}): kept, a redirect pays "
            f"the whole prefill again")


def _check_line(check: Check, reason: str, cap: float | None = None,
                figures: tuple[tuple[str, float], ...] = ()) -> str:
    """One replica of the walk; ``cap`` and ``figures``: llm-aware's normal cap and index figures."""
    after = check.load + check.cost
    head = f"  {check.replica}: {check.load}+{check.cost}={after}"
    limit = f"long_cap={_num(check.limit)}" if check.long_limit else _num(check.limit)
    if not check.accepted:
        return f"{head} > {limit} → skip"
    if after > check.limit and check.load == 0:
        return f"{head} > {limit} but idle → {reason}"
    if after > check.limit and check.load >= check.limit:  # the prefix index's cap in requests let it in
        named = dict(figures)
        return (f"{head} > {limit} but {int(named['requests']) + 1} requests ≤ the cap in requests "
                f"{_num(named['requests_cap'])}: cached → {reason}")
    if after > check.limit:
        return f"{head} > {limit} but {check.load} < {limit}: cached, one request of slack → {reason}"
    if check.long_limit and cap is not None and after > cap:
        return f"{head} ≤ {limit} (> normal cap={_num(cap)}) → {reason}"
    return f"{head} ≤ {limit} → {reason}"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
