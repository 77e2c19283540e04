"""Simulator inputs: the profile's conversations (same as the Locust users') and Mooncake traces."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple, TypeVar

from extproc.routing.blocks import model_seed
from extproc.routing.continuation import of_model
from extproc.sim.engine import ClosedLoop, Mixed, OpenLoop
from extproc.sim.mooncake import TraceRequest, infer_conversations
from extproc.sim.request import Request
from extproc.sim.router_mode import model_key
from extproc.traffic import Profile, generate_conversations, load_profile


class TenantLoad(NamedTuple):
    """One tenant of a mix: its requests name ``tenant`` and ``objective`` ("": none), and its
    users follow ``profile`` (extproc/traffic/profiles)."""

    tenant: str
    objective: str
    profile: str


# A quiet tenant's few short chats beside a noisy one pasting documents without pause: the
# scenario of `llm-ring bench flow`, scaled to a fleet; both in the default band, so only the
# order between tenants protects the quiet one
MIXES: dict[str, tuple[TenantLoad, ...]] = {
    "noisy-neighbour": (TenantLoad("quiet", "", "tenant-quiet"), TenantLoad("noisy", "", "tenant-noisy")),
}

# A profile prompt as the block-aware policies see it: the service cuts a prompt's text into
# blocks of the policy's prefix_block_chars characters, at 4 characters a token (router.toml
# chars_per_token).
CHARS_PER_TOKEN = 4


def profile_workload(profile: Profile, seed: int, block_chars: int = 0, tenant: str = "",
                     objective: str = "") -> ClosedLoop:
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
    With a ``tenant``, its requests carry it and ``objective``, and its conversations are its
    own (ids ``<tenant>/<id>``): another tenant's profile makes the same ids.
    """
    block_tokens = block_chars // CHARS_PER_TOKEN
    firsts = []
    for number, conversation in enumerate(generate_conversations(profile, seed)):
        previous = None
        name = f"{tenant}/{conversation.id}" if tenant else conversation.id
        for turn_number, turn in enumerate(conversation.turns, start=1):
            request = Request(
                f"{name}-t{turn_number}", name, turn_number, (tenant, number) if tenant else number, None,
                turn.est_prompt_tokens, turn.max_tokens, think_s=turn.think_time_s,
            )
            request.tenant, request.objective = tenant, objective
            if block_tokens:
                _add_blocks(request, block_tokens)
            if turn.parallel:
                request.sides = tuple(
                    _side(request, f"{name}/p{k}", side.est_prompt_tokens, block_tokens)
                    for k, side in enumerate(turn.parallel, start=1)
                )
                request.waiting = 1 + len(request.sides)
            if previous is None:
                firsts.append(request)
            else:
                previous.next, request.previous = request, previous
            previous = request
    return ClosedLoop(firsts, profile.concurrency, profile.spawn_rate, profile.max_duration_s)


def mixed_workload(mix: tuple[TenantLoad, ...], seed: int, block_chars: int = 0) -> Mixed:
    """Each tenant's users, conversations (its profile's, with the seed) side by side."""
    return tuple(profile_workload(load_profile(load.profile), seed, block_chars, load.tenant, load.objective)
                 for load in mix)


def _add_blocks(request: Request, block_tokens: int) -> None:
    key = request.key  # the conversation's number: hashes of int tuples are the same in every process
    count = request.prompt_tokens // block_tokens
    request.route = request.route._replace(prefix_blocks=tuple(hash((key, index)) for index in range(count)))


def _side(turn: Request, recorded_as: str, prompt_tokens: int, block_tokens: int) -> Request:
    side = Request(f"{turn.request_id}-{recorded_as.rpartition('/')[2]}", recorded_as, turn.turn, turn.key, None,
                   prompt_tokens, turn.max_tokens)  # fmt: skip
    # routed as its turn's conversation (keyed under it when sent: engine.py)
    side.route = side.route._replace(conversation=turn.conversation)
    if block_tokens:
        _add_blocks(side, block_tokens)
    side.head = turn
    side.tenant, side.objective = turn.tenant, turn.objective
    return side


def requests_from_trace(
    trace: list[TraceRequest], time_scale: float = 1.0, arrivals: list[float] | None = None,
    tenants: tuple[tuple[str, int], ...] = (),
) -> OpenLoop:
    """The trace's requests, each at ``arrivals`` (default: its timestamp) × ``time_scale``.

    A request's prefix key is its first block's hash id; a plain trace (no hash ids) gives
    every request its own key, so nothing is shared. ``tenants`` ((name, weight) ...): each
    inferred conversation belongs to one, by a hash of its id (tenant_of).
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
        if tenants:
            requests[-1].tenant = tenant_of(requests[-1].conversation, tenants)
    return OpenLoop(requests)


def tenant_of(conversation: str, tenants: tuple[tuple[str, int], ...]) -> str:
    """The tenant a conversation belongs to: its id's CRC-32 among the tenants' weights (stable
    across processes and Python versions, unlike ``hash``)."""
    return _weighted(zlib.crc32(conversation.encode()) % sum(weight for _, weight in tenants), tenants)


def with_models(workload: ClosedLoop | OpenLoop | Mixed, shares: Mapping[str, float], seed: int) -> None:
    """Each conversation names a model, in proportion to ``shares`` (by a CRC-32 of the seed and its
    id), as a client's ``model`` field: its route carries it, its conversation and prefix blocks are
    keyed under it (as the service keys them: ``continuation.of_model``, ``blocks.model_seed``), and
    so is its prompt cache on the replicas (``router_mode.model_key``)."""
    loops = (workload,) if isinstance(workload, ClosedLoop | OpenLoop) else workload
    total, items = sum(shares.values()), tuple(shares.items())
    for loop in loops:
        for request in _every_request(loop):
            point = zlib.crc32(f"{seed}/{request.head.conversation}".encode()) / 2**32 * total
            name_model(request, _weighted(point, items))


def _every_request(loop: ClosedLoop | OpenLoop) -> Iterable[Request]:
    if isinstance(loop, OpenLoop):
        yield from loop.requests
        return
    for first in loop.conversations:
        turn: Request | None = first
        while turn is not None:
            yield turn
            yield from turn.sides
            turn = turn.next


def name_model(request: Request, model: str) -> None:
    seed = model_seed(model)
    request.key = model_key(model, request.key)
    route = request.route
    request.route = route._replace(model=model, conversation=of_model(model, route.conversation),
                                   prefix_blocks=tuple(hash((seed, block)) for block in route.prefix_blocks))


Named = TypeVar("Named")


def _weighted(point: float, weights: tuple[tuple[Named, float], ...]) -> Named:
    """The item whose stretch of the weights' sum holds ``point`` (0 <= point < the sum)."""
    for name, weight in weights:
        if point < weight:
            return name
        point -= weight
    return weights[-1][0]  # a float sum's rounding: the last stretch
