"""Decision traces as text, the way an operator reads them (the edge of the core)."""

from __future__ import annotations

from extproc.routing.decision import Candidate, Check, Decision, Trace

CANDIDATES_SHOWN = 8
LOWEST_WINS = frozenset({"kv-cost"})  # peer policies whose candidate score is a cost


def render_trace(decision: Decision) -> str:
    trace = decision.trace
    lines = [f"{_title(trace)} → {decision.replica} ({decision.reason})"]
    if trace.preferred_by is not None:
        lines.append(_preference_line(trace))
    if trace.preferred_by is not None and trace.preferred_cost is not None and trace.preferred:
        lines.append(_cost_line(trace))
    if trace.total is not None and trace.cap is not None:
        lines.append(_load_line(trace))
    if trace.long_cap is not None:
        lines.append(
            f"  long stickiness: prompt_tokens={trace.prompt_tokens} ≥ {trace.long_threshold} and "
            f"cache_likely=True → long_cap={_num(trace.long_cap)}"
        )
    lines.extend(_check_line(check, trace, decision.reason) for check in trace.checks)
    if trace.predicted:
        weighed = " ".join(f"{name}={seconds:.3f} s" for name, seconds in trace.predicted)
        lines.append(f"  predicted first token: {weighed} → {decision.reason}")
    if decision.reason == "kept":
        lines.append(_kept_line(decision))
    if trace.prompt_blocks is not None:
        lines.extend(_peer_lines(decision))
    if trace.details is not None:  # a policy's own NamedTuple, as Trace.as_dict gives it
        lines.append("  " + " ".join(f"{name}={value}" for name, value in trace.as_dict()["details"].items()))
    return "\n".join(lines)


def _peer_lines(decision: Decision) -> list[str]:
    trace = decision.trace
    lines = [f"  prompt: {trace.prompt_blocks} blocks; predicted cached on the pick: {decision.predicted_cached_tokens}"
             f" of {trace.prompt_tokens} tokens"]
    if trace.cap is None:  # chwbl shows its loads with the cap already
        lines.append("  in flight (requests): " + " ".join(f"{name}={load}" for name, load in trace.loads.items()))
    if trace.figures:
        lines.append("  " + " ".join(f"{name}={value:.3g}" for name, value in trace.figures))
    ranked = sorted(trace.candidates, key=lambda c: c.score, reverse=trace.policy not in LOWEST_WINS)
    lines.extend(_candidate_line(candidate, decision.replica) for candidate in ranked[:CANDIDATES_SHOWN])
    if len(ranked) > CANDIDATES_SHOWN:
        lines.append(f"  … {len(ranked) - CANDIDATES_SHOWN} more candidates")
    return lines


def _candidate_line(candidate: Candidate, chosen: str) -> str:
    mark = " ← pick" if candidate.replica == chosen else ""
    return (f"  {candidate.replica}: matched {candidate.matched_blocks} blocks, load {candidate.load}, "
            f"score {candidate.score:.3f}{mark}")


def _title(trace: Trace) -> str:
    if trace.policy == "bounded":
        return f"bounded ({trace.unit.removesuffix('s') if trace.unit else '?'} mode)"
    return trace.policy


def _preference_line(trace: Trace) -> str:
    if trace.remembered is not None:
        memory = f"last served on {trace.remembered} with {trace.remembered_tokens} prompt tokens"
    else:
        memory = "nothing remembered"
    if trace.preferred_by == "memory":
        return f"  placement memory: {memory} → preferred={trace.preferred}"
    if trace.preferred_by == "prefix":
        return (f"  prefix index: {trace.preferred} holds the longest prefix ({trace.cached_tokens} of "
                f"{trace.prompt_tokens} tokens; ring home {trace.home}) → preferred={trace.preferred}")
    if trace.preferred_by == "lru":
        use = dict(trace.figures or ()).get("least_recent_use")
        oldest = "has room for it" if use is not None and use < 0 else f"least recent prompt is the oldest (use {use})"
        return (f"  prefix index: no replica holds any of the prompt; under the cap {trace.preferred}'s {oldest}"
                f" (ring home {trace.home}) → preferred={trace.preferred}")
    return f"  ring home: {trace.home} ({memory}) → preferred={trace.preferred}"


def _cost_line(trace: Trace) -> str:
    new = trace.prompt_tokens - trace.cached_tokens
    if trace.cached_tokens:
        return (
            f"  cost on {trace.preferred}: max(1, {trace.prompt_tokens}-{trace.cached_tokens})="
            f"{max(1, new)} + {trace.max_tokens} = {trace.preferred_cost} (new tokens only, cache hit)"
        )
    return (
        f"  cost on {trace.preferred}: {trace.prompt_tokens} + {trace.max_tokens} = "
        f"{trace.preferred_cost} (whole history, no cache)"
    )


def _load_line(trace: Trace) -> str:
    loads = " ".join(f"{name}={load}" for name, load in trace.loads.items())
    if trace.preferred_by is not None:  # llm-aware: cost depends on the replica
        return (
            f"  load ({trace.unit}): {loads}; +{trace.preferred_cost} → total={trace.total}, "
            f"avg={_num(trace.average)}, cap={_num(trace.cap)}"
        )
    return f"  load ({trace.unit}): {loads}; with this request total={trace.total}, cap={_num(trace.cap)}"


def _kept_line(decision: Decision) -> str:
    trace = decision.trace
    landing = {check.replica: check.load + check.cost for check in trace.checks}
    others = [after for name, after in landing.items() if name != decision.replica]
    factor = trace.cap / trace.average if trace.cap is not None and trace.average else 1.0  # = 1 + ε
    return (f"  none fitted under the cap; {decision.replica} lands at {landing.get(decision.replica)}, "
            f"no other at {factor:.3g}x lower (least {min(others) if others else '-'}): kept, a redirect pays "
            f"the whole prefill again")


def _check_line(check: Check, trace: Trace, reason: str) -> str:
    after = check.load + check.cost
    head = f"  {check.replica}: {check.load}+{check.cost}={after}"
    limit = f"long_cap={_num(check.limit)}" if check.long_limit else _num(check.limit)
    if not check.accepted:
        return f"{head} > {limit} → skip"
    if after > check.limit and check.load == 0:
        return f"{head} > {limit} but idle → {reason}"
    if after > check.limit and check.load >= check.limit:  # the prefix index's cap in requests let it in
        figures = dict(trace.figures)
        return (f"{head} > {limit} but {int(figures['requests']) + 1} requests ≤ the cap in requests "
                f"{_num(figures['requests_cap'])}: cached → {reason}")
    if after > check.limit:
        return f"{head} > {limit} but {check.load} < {limit}: cached, one request of slack → {reason}"
    if check.long_limit and trace.cap is not None and after > trace.cap:
        return f"{head} ≤ {limit} (> normal cap={_num(trace.cap)}) → {reason}"
    return f"{head} ≤ {limit} → {reason}"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
