"""Other routers' picture in the core: the ledger's elsewhere part, peer_view's answered
requests, and the router deciding with both (extproc/routing/peers.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from extproc.routing import LoadLedger, Router, RouteRequest
from extproc.routing.peers import PeerRequest, PeerView, latest, peer_view
from extproc.routing.placement import Placement
from tests.routing.conftest import key_with_walk, routing

REPLICAS = ["a", "b", "c"]
counts = st.integers(-5, 50)
replica_loads = st.dictionaries(st.sampled_from([*REPLICAS, "gone"]), st.tuples(counts, st.integers(-100, 5000)))
routers = st.sampled_from(["r1", "r2", "r3", "dead"])
pending_requests = st.lists(st.builds(PeerRequest, routers, st.sampled_from(REPLICAS), st.integers(0, 5000),
                                      st.integers(0, 5000), st.integers(1, 6)), max_size=12)


class LedgerWithPeersMachine(RuleBasedStateMachine):
    """Own charges and peers' snapshots in any order: the policies see own + elsewhere, never
    negative; the own figures are exactly the outstanding charges; releasing stays idempotent."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = LoadLedger(REPLICAS)
        self.replicas = set(REPLICAS)
        self.charges: dict[str, tuple[str, int]] = {}
        self.elsewhere: dict[str, tuple[int, int]] = {}
        self.next_id = 0

    @rule(replica=st.sampled_from(REPLICAS), tokens=st.integers(0, 5000))
    def charge(self, replica: str, tokens: int) -> None:
        if replica in self.replicas:
            request_id = f"r{self.next_id}"
            self.next_id += 1
            self.ledger.charge(request_id, replica, tokens)
            self.charges[request_id] = (replica, tokens)

    @rule(index=st.integers(0, 60), twice=st.booleans())
    def release(self, index: int, twice: bool) -> None:
        expected = self.charges.pop(f"r{index}", None)
        assert self.ledger.release(f"r{index}") == expected
        if twice:
            assert self.ledger.release(f"r{index}") is None

    @rule(snapshot=replica_loads)
    def peers(self, snapshot: dict[str, tuple[int, int]]) -> None:
        self.ledger.set_elsewhere(snapshot)
        self.elsewhere = {name: (max(0, r), max(0, t)) for name, (r, t) in snapshot.items() if name in self.replicas}

    @rule(replicas=st.sets(st.sampled_from(REPLICAS)))
    def rediscover(self, replicas: set[str]) -> None:
        self.ledger.set_replicas(replicas)
        self.replicas = replicas
        self.charges = {rid: charge for rid, charge in self.charges.items() if charge[0] in replicas}
        self.elsewhere = {name: load for name, load in self.elsewhere.items() if name in replicas}

    @invariant()
    def seen_is_own_plus_elsewhere(self) -> None:
        for unit, index in (("requests", 0), ("tokens", 1)):
            seen = self.ledger.loads(unit)
            assert set(seen) == self.replicas
            for replica in self.replicas:
                own = [tokens for name, tokens in self.charges.values() if name == replica]
                own_figure = len(own) if unit == "requests" else sum(own)
                assert seen[replica] == own_figure + self.elsewhere.get(replica, (0, 0))[index] >= 0
            assert self.ledger.total(unit) == sum(seen.values())
        assert self.ledger.total_requests() == len(self.charges) == self.ledger.in_flight()
        assert self.ledger.total_tokens() == sum(tokens for _, tokens in self.charges.values())


TestLedgerWithPeersMachine = LedgerWithPeersMachine.TestCase


def test_without_peers_the_policies_read_the_own_counters_themselves() -> None:
    ledger = LoadLedger(REPLICAS)
    ledger.set_elsewhere({"a": (2, 10)})
    ledger.set_elsewhere({})
    ledger.charge("r", "a", 5)
    assert ledger.loads("tokens") == {"a": 5, "b": 0, "c": 0} and ledger.elsewhere() == {}
    assert ledger.clear() is None and ledger.total("tokens") == 0


@given(loads=st.dictionaries(st.sampled_from(["r1", "r2", "r3"]), replica_loads), pending=pending_requests,
       answered=st.frozensets(st.integers(1, 6)))
def test_peer_view_leaves_out_only_answered_requests_of_live_routers(loads, pending, answered) -> None:
    view = peer_view(loads, pending, answered, None)
    assert all(requests >= 0 and tokens >= 0 for requests, tokens in view.elsewhere.values())
    published = {}
    for by_replica in loads.values():
        for replica, (requests, tokens) in by_replica.items():
            so_far = published.get(replica, (0, 0))
            published[replica] = (so_far[0] + max(0, requests), so_far[1] + max(0, tokens))
    counted = [p for p in pending if p.router in loads and p.history in answered]
    for replica, (requests, tokens) in published.items():
        seen = view.elsewhere.get(replica, (0, 0))
        assert requests - sum(1 for p in counted if p.replica == replica) <= seen[0] <= requests
        assert tokens - sum(p.charged_tokens for p in counted if p.replica == replica) <= seen[1] <= tokens
    assert view.elsewhere == peer_view(loads, [p for p in pending if p in counted], answered, None).elsewhere
    if counted:
        assert view.placement is not None
        assert view.placement.prompt_tokens == max(p.prompt_tokens for p in counted)
    else:
        assert view.placement is None


def test_an_answered_request_elsewhere_is_where_the_cache_is_even_before_its_placement_is_written() -> None:
    loads = {"r1": {"b": (1, 300)}}
    answered_elsewhere = PeerRequest("r1", "b", 300, 250, history=7)
    view = peer_view(loads, [answered_elsewhere], frozenset({7}), Placement("a", 100))
    assert view.elsewhere == {"b": (0, 0)} and view.placement == Placement("b", 250)
    still_running = peer_view(loads, [answered_elsewhere], frozenset({8}), Placement("a", 100))
    assert still_running.elsewhere == {"b": (1, 300)} and still_running.placement == Placement("a", 100)
    gone_router = peer_view({}, [answered_elsewhere], frozenset({7}), None)
    assert gone_router == PeerView({}, None)


def test_the_later_placement_is_the_one_with_more_prompt_tokens() -> None:
    old, new = Placement("a", 100), Placement("b", 400)
    assert latest(old, new) == new and latest(new, old) == new
    assert latest(None, old) == old and latest(old, None) == old
    assert latest(old, Placement("c", 100)) == old  # a tie keeps what this router knows


def test_a_router_uses_a_later_shared_placement_and_remembers_it() -> None:
    router = Router(routing(), REPLICAS)
    conversation = key_with_walk(router, "a", "b")
    first = router.route(RouteRequest("1", conversation, 100, 16)).decision
    assert first.replica == "a"
    router.complete("1")
    shared = PeerView({}, Placement("b", 400))  # a later turn, served on b through another router
    decision = router.route(RouteRequest("2", conversation, 500, 16), peers=shared).decision
    assert decision.replica == "b" and decision.predicted_cached_tokens == 400
    router.complete("2")
    again = router.route(RouteRequest("3", conversation, 600, 16), peers=PeerView({}, Placement("a", 100))).decision
    assert again.replica == "b"  # an older shared entry loses to this router's own


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 3000), st.booleans(), replica_loads),
                    min_size=1, max_size=60),
       unit=st.sampled_from(["requests", "tokens"]))
def test_the_bound_holds_on_the_load_seen_with_peers(ops, unit) -> None:
    router = Router(routing(policy="bounded", load_unit=unit), REPLICAS)
    open_ids: list[str] = []
    for index, (conversation, prompt, complete, elsewhere) in enumerate(ops):
        if complete and open_ids:
            router.complete(open_ids.pop(0))
        decision = router.route(RouteRequest(str(index), f"c{conversation}", prompt, 16),
                                peers=PeerView(elsewhere, None)).decision
        open_ids.append(str(index))
        before = dict(decision.trace.details.loads)
        assert decision.trace.details.total == sum(before.values()) + decision.cost
        fits = [name for name, load in before.items() if load + decision.cost <= decision.trace.details.cap]
        if fits:
            assert before[decision.replica] + decision.cost <= decision.trace.details.cap
    for request_id in open_ids:
        router.complete(request_id)
    assert router.ledger.total_requests() == router.ledger.total_tokens() == 0
