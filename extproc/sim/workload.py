"""Simulator inputs: the profile's conversations (same as the Locust users') and Mooncake traces."""

from __future__ import annotations

from extproc.sim.engine import ClosedLoop, OpenLoop
from extproc.sim.mooncake import TraceRequest, infer_conversations
from extproc.sim.request import Request
from extproc.traffic import Profile, generate_conversations

# A profile prompt as the block-aware policies see it: the service cuts a prompt's text into
# blocks of the policy's prefix_block_chars characters, at 4 characters a token (router.toml
# chars_per_token).
CHARS_PER_TOKEN = 4


def profile_workload(profile: Profile, seed: int, block_chars: int = 0) -> ClosedLoop:
    """The seed's conversations, each turn's prompt = whole history with answers at max_tokens;
    with ``block_chars``, each prompt carries its prefix blocks of that many characters.

    The prompt size is the generator's estimate (characters / chars_per_token plus
    chat-template tokens), used both as what the router sees and as what the replica
    processes; answers are exactly max_tokens long (the live runs send ignore_eos).
    A fan-out turn's parallel sides are sent with it under the same conversation (the router
    sees one conversation, as with Locust's x-conversation-id) and recorded as conversations
    ``<id>/p<k>`` of their own, as Locust records them. A side shares the whole history with
    its turn; the simulated cache credits it with its turn's length (the short side message
    is over-credited).
    """
    block_tokens = block_chars // CHARS_PER_TOKEN
    firsts = []
    for number, conversation in enumerate(generate_conversations(profile, seed)):
        previous = None
        for turn_number, turn in enumerate(conversation.turns, start=1):
            request = Request(
                f"{conversation.id}-t{turn_number}", conversation.id, turn_number, number, None,
                turn.est_prompt_tokens, turn.max_tokens, think_s=turn.think_time_s,
            )
            if block_tokens:
                _add_blocks(request, block_tokens)
            if turn.parallel:
                request.sides = tuple(
                    _side(request, f"{conversation.id}/p{k}", side.est_prompt_tokens, block_tokens)
                    for k, side in enumerate(turn.parallel, start=1)
                )
                request.waiting = 1 + len(request.sides)
            if previous is None:
                firsts.append(request)
            else:
                previous.next, request.previous = request, previous
            previous = request
    return ClosedLoop(firsts, profile.concurrency, profile.spawn_rate, profile.max_duration_s)


def _add_blocks(request: Request, block_tokens: int) -> None:
    key = request.key  # the conversation's number: hashes of int tuples are the same in every process
    count = request.prompt_tokens // block_tokens
    request.route = request.route._replace(prefix_blocks=tuple(hash((key, index)) for index in range(count)))


def _side(turn: Request, recorded_as: str, prompt_tokens: int, block_tokens: int) -> Request:
    side = Request(f"{turn.request_id}-{recorded_as.rpartition('/')[2]}", recorded_as, turn.turn, turn.key, None,
                   prompt_tokens, turn.max_tokens)  # fmt: skip
    side.route = side.route._replace(conversation=turn.conversation)  # routed as its turn's conversation
    if block_tokens:
        _add_blocks(side, block_tokens)
    side.head = turn
    return side


def requests_from_trace(
    trace: list[TraceRequest], time_scale: float = 1.0, arrivals: list[float] | None = None
) -> OpenLoop:
    """The trace's requests, each at ``arrivals`` (default: its timestamp) × ``time_scale``.

    A request's prefix key is its first block's hash id; a plain trace (no hash ids) gives
    every request its own key, so nothing is shared.
    """
    conversations = infer_conversations(trace)
    turns: dict[int, int] = {}
    requests = []
    for number, (item, conversation) in enumerate(zip(trace, conversations, strict=True)):
        turns[conversation] = turns.get(conversation, 0) + 1
        at = item.timestamp_s if arrivals is None else arrivals[number]
        hashes = item.hash_ids
        requests.append(Request(
            f"r{number:06d}", f"m{conversation:05d}", turns[conversation], hashes[0] if hashes else ("r", number),
            hashes or None, item.input_length, item.output_length, arrival_s=at * time_scale,
        ))
    return OpenLoop(requests)
