"""`llm-ring bench flow`'s figures, from replies made up here: the quiet tenant's TTFT quantiles,
its follow-ups that stayed on their replica, the noisy answers and the answered tokens per second."""

from __future__ import annotations

from extproc.bench.flow import Phase, Reply, render, summary


def reply(tenant: str, conversation: str, turn: int, replica: str, ttft_s: float, finished: float,
          status: int = 200) -> Reply:
    return Reply(tenant, conversation, turn, status, ttft_s, replica, generated=10, cache_n=0, waited_ms=None,
                 finished=finished)


def test_a_phase_is_summarised_from_its_replies() -> None:
    phase = Phase(started=0.0, replies=[
        reply("quiet", "q0", 1, "llm-0", 0.2, 1.0), reply("quiet", "q0", 2, "llm-0", 0.4, 2.0),
        reply("quiet", "q0", 3, "llm-1", 1.0, 3.0),  # moved away from its replica
        reply("noisy", "n0", 1, "llm-1", 5.0, 4.0), reply("noisy", "n0", 2, "llm-1", 5.0, 5.0, status=429),
    ])
    figures = summary([phase])
    assert figures["quiet_requests"] == 3 and figures["quiet_ok"] == 3
    assert figures["quiet_ttft_p50_s"] == 0.4 and figures["quiet_ttft_p95_s"] == 0.94  # between 0.4 and 1.0
    assert (figures["quiet_followups"], figures["quiet_followups_on_their_replica"]) == (2, 1)
    assert (figures["noisy_answers"], figures["noisy_followups_on_their_replica"], figures["refused"]) == (1, 1, 1)
    assert figures["answered_tokens_per_s"] == 10.0  # 50 tokens over the phase's 5 s


def test_the_table_shows_both_phases_and_the_ratio() -> None:
    alone = summary([Phase(started=0.0, replies=[reply("quiet", "q0", 1, "llm-0", 0.5, 1.0)])])
    flood = summary([Phase(started=0.0, replies=[reply("quiet", "q0", 1, "llm-0", 1.5, 2.0)])])
    table = render({"alone": alone, "flood": flood, "quiet_p95_ratio": 3.0})
    assert "quiet_ttft_p95_s" in table and "0.5" in table and "1.5" in table
    assert table.splitlines()[-1] == "quiet tenant's p95 TTFT, flood / alone: 3.0"
