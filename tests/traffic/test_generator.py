import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing.tokens import estimate_tokens
from extproc.traffic import generate_conversation, generate_conversations, load_profile

QUICK = load_profile("quick")


def test_same_seed_gives_identical_conversations_in_another_process():
    # A fresh interpreter rules out anything process-local (hash salting, global RNG state).
    code = (
        "import json; from extproc.traffic import *; "
        "cs = generate_conversations(load_profile('quick'), 7); "
        "print(json.dumps([[c.id, [[t.text, t.think_time_s, t.max_tokens] for t in c.turns]] "
        "for c in cs]))"
    )
    other = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True).stdout)
    here = [[c.id, [[t.text, t.think_time_s, t.max_tokens] for t in c.turns]] for c in generate_conversations(QUICK, 7)]
    assert other == here


def test_different_seeds_differ_and_ids_carry_the_seed():
    one, two = generate_conversations(QUICK, 1), generate_conversations(QUICK, 2)
    assert [c.turns for c in one] != [c.turns for c in two]
    assert one[0].id == "s1-c00000" and two[0].id == "s2-c00000"
    assert len({c.id for c in one}) == QUICK.conversations


def test_each_conversation_is_its_own_stream():
    # Generating conversation 5 alone gives what it is within the whole list.
    assert generate_conversation(QUICK, 3, 5) == generate_conversations(QUICK, 3)[5]


def test_standard_profile_matches_the_seed_description():
    standard = load_profile("standard")
    conversations = generate_conversations(standard, 1)
    assert standard.concurrency == 50
    share = sum(c.has_document for c in conversations) / len(conversations)
    assert 0.15 <= share <= 0.45  # 30% nominal
    first_doc = next(c for c in conversations if c.has_document).turns[0].text
    assert 550 <= len(first_doc.split()) <= 700
    assert all(5 <= len(c.turns) <= 10 for c in conversations if c.turns[-1].est_prompt_tokens < 3000)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**31))
def test_turns_respect_the_profile(seed):
    for conversation in generate_conversations(QUICK, seed):
        assert 1 <= len(conversation.turns) <= QUICK.turns[1]
        history = 0
        for number, turn in enumerate(conversation.turns, start=1):
            assert turn.max_tokens == QUICK.max_tokens
            assert QUICK.think_time_s[0] <= turn.think_time_s <= QUICK.think_time_s[1]
            assert turn.est_prompt_tokens + turn.max_tokens <= QUICK.max_context_tokens
            history += len(turn.text)
            # the estimate grows with the history and counts earlier answers at max_tokens
            assert turn.est_prompt_tokens >= estimate_tokens(history, QUICK.chars_per_token) + (number - 1) * 16


def test_the_agent_profile_sends_long_system_prompts_tool_results_and_fan_outs():
    agent = load_profile("agent")
    conversations = [c for seed in (1, 2, 3) for c in generate_conversations(agent, seed)]
    for conversation in conversations:
        assert agent.system_words[0] <= len(conversation.system.split()) <= agent.system_words[1]
        assert all(turn.think_time_s == 0 for turn in conversation.turns)
        fan_outs = [turn for turn in conversation.turns if turn.parallel]
        assert len(fan_outs) <= 1
        for turn in fan_outs:
            assert agent.fanout_requests[0] <= 1 + len(turn.parallel) <= agent.fanout_requests[1]
            assert all(side.text != turn.text and side.est_prompt_tokens > 0 for side in turn.parallel)
        assert not conversation.turns[0].text.startswith("Tool result:")  # a first turn is a question
    follow_ups = [turn for c in conversations for turn in c.turns[1:]]
    tool_share = sum(turn.text.startswith("Tool result:") for turn in follow_ups) / len(follow_ups)
    fanned = sum(any(turn.parallel for turn in c.turns) for c in conversations) / len(conversations)
    assert abs(tool_share - agent.tool_share) < 0.2 and abs(fanned - agent.fanout_share) < 0.3
    # the system prompt counts in every turn's estimate
    assert all(c.turns[0].est_prompt_tokens > len(c.system) / agent.chars_per_token for c in conversations)
