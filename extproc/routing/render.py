"""Decision traces as text, the way an operator reads them (the edge of the core).

A policy's trace details render themselves (``RendersItself``: a ``render`` method beside the
trace type); the lines several policies share are here. Details without one are shown as one
line of ``name=value``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from extproc.routing.decision import Candidate, Check, Decision, detail_fields

CANDIDATES_SHOWN = 8


@runtime_checkable
class RendersItself(Protocol):
    def render(self, decision: Decision) -> list[str]:
        """Every line of ``decision``'s text (it carries these details), its ``headline`` first."""
        ...


def render_trace(decision: Decision) -> str:
    details = decision.trace.details
    if isinstance(details, RendersItself):
        return "\n".join(details.render(decision))
    lines = [headline(decision)]
    if details is not None:  # another policy's own NamedTuple
        lines.append("  " + " ".join(f"{name}={value}" for name, value in detail_fields(details).items()))
    return "\n".join(lines)


def headline(decision: Decision, title: str | None = None) -> str:
    """The pick and its reason, under ``title`` (the policy's name unless given)."""
    return f"{title or decision.trace.policy} → {decision.replica} ({decision.reason})"


def peer_lines(decision: Decision, prompt_blocks: int, loads: Mapping[str, int], cap: float | None,
               figures: tuple[tuple[str, float], ...], candidates: tuple[Candidate, ...],
               lowest_wins: bool = False) -> list[str]:
    """The prompt, the loads (unless shown with ``cap`` already), the figures and the candidates,
    best score first (``lowest_wins``: the score is a cost)."""
    trace = decision.trace
    lines = [f"  prompt: {prompt_blocks} blocks; predicted cached on the pick: {decision.predicted_cached_tokens}"
             f" of {trace.prompt_tokens} tokens"]
    if cap is None:  # chwbl and llm-aware show their loads with the cap already
        lines.append("  in flight (requests): " + " ".join(f"{name}={load}" for name, load in loads.items()))
    if figures:
        lines.append("  " + " ".join(f"{name}={value:.3g}" for name, value in figures))
    ranked = sorted(candidates, key=lambda c: c.score, reverse=not lowest_wins)
    lines.extend(_candidate_line(candidate, decision.replica) for candidate in ranked[:CANDIDATES_SHOWN])
    if len(ranked) > CANDIDATES_SHOWN:
        lines.append(f"  … {len(ranked) - CANDIDATES_SHOWN} more candidates")
    return lines


def _candidate_line(candidate: Candidate, chosen: str) -> str:
    mark = " ← pick" if candidate.replica == chosen else ""
    return (f"  {candidate.replica}: matched {candidate.matched_blocks} blocks, load {candidate.load}, "
            f"score {candidate.score:.3f}{mark}")


def load_line(unit: str, loads: Mapping[str, int], total: int, cap: float) -> str:
    shown = " ".join(f"{name}={load}" for name, load in loads.items())
    return f"  load ({unit}): {shown}; with this request total={total}, cap={num(cap)}"


def check_line(check: Check, reason: str, cap: float | None = None,
               figures: tuple[tuple[str, float], ...] = ()) -> str:
    """One replica of the bounded walk; ``cap`` and ``figures``: llm-aware's normal cap and index figures."""
    after = check.load + check.cost
    head = f"  {check.replica}: {check.load}+{check.cost}={after}"
    limit = f"long_cap={num(check.limit)}" if check.long_limit else num(check.limit)
    if not check.accepted:
        return f"{head} > {limit} → skip"
    if after > check.limit and check.load == 0:
        return f"{head} > {limit} but idle → {reason}"
    if after > check.limit and check.load >= check.limit:  # the prefix index's cap in requests let it in
        named = dict(figures)
        return (f"{head} > {limit} but {int(named['requests']) + 1} requests ≤ the cap in requests "
                f"{num(named['requests_cap'])}: cached → {reason}")
    if after > check.limit:
        return f"{head} > {limit} but {check.load} < {limit}: cached, one request of slack → {reason}"
    if check.long_limit and cap is not None and after > cap:
        return f"{head} ≤ {limit} (> normal cap={num(cap)}) → {reason}"
    return f"{head} ≤ {limit} → {reason}"


def num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
