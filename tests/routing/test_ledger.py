from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from extproc.routing import LoadLedger


def test_release_is_idempotent_and_unknown_ids_are_harmless() -> None:
    ledger = LoadLedger(["a", "b"])
    ledger.charge("r1", "a", 100)
    assert ledger.release("r1") == ("a", 100)
    assert ledger.release("r1") is None
    assert ledger.release("never-charged") is None
    assert (ledger.requests("a"), ledger.tokens("a"), ledger.total_tokens()) == (0, 0, 0)


def test_charging_twice_or_an_unknown_replica_is_refused() -> None:
    ledger = LoadLedger(["a"])
    ledger.charge("r1", "a", 1)
    with pytest.raises(ValueError, match="already charged"):
        ledger.charge("r1", "a", 1)
    with pytest.raises(KeyError, match="unknown replica"):
        ledger.charge("r2", "zzz", 1)


def test_a_removed_replica_takes_its_in_flight_load_with_it() -> None:
    ledger = LoadLedger(["a", "b"])
    ledger.charge("on-a", "a", 10)
    ledger.charge("on-b", "b", 20)
    ledger.set_replicas(["b"])
    assert ledger.total_tokens() == 20 and ledger.in_flight() == 1
    assert ledger.release("on-a") is None  # completing it later releases nothing
    ledger.set_replicas(["a", "b"])  # back again: a fresh server, empty
    assert ledger.tokens("a") == 0 and ledger.total_requests() == 1


def test_a_journal_keeps_each_charge_and_release_held_and_charges_lists_the_own_in_flight() -> None:
    assert LoadLedger(["a"]).journal is None  # none unless asked for
    ledger = LoadLedger(["a", "b"])
    ledger.journal = []
    ledger.charge("r1", "a", 10)
    ledger.charge("r2", "b", 20)
    ledger.release("r1")
    ledger.release("r1")  # nothing held: not kept
    ledger.set_elsewhere({"a": (3, 300)})  # the others' load: not this ledger's change
    assert ledger.journal == [("r1", "a", 10), ("r2", "b", 20), ("r1", "", 0)]
    assert dict(ledger.charges()) == {"r2": ("b", 20)}
    ledger.set_replicas(["a"])  # r2's load went with b: no release is kept for it
    assert len(ledger.journal) == 3 and dict(ledger.charges()) == {}


class LedgerMachine(RuleBasedStateMachine):
    """Counters always equal the sum of outstanding charges, whatever the order of events."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = LoadLedger(["a", "b", "c"])
        self.replicas = {"a", "b", "c"}
        self.model: dict[str, tuple[str, int]] = {}
        self.next_id = 0

    @rule(replica=st.sampled_from(["a", "b", "c", "d"]), tokens=st.integers(0, 5000))
    def charge(self, replica: str, tokens: int) -> None:
        if replica not in self.replicas:
            return
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.ledger.charge(request_id, replica, tokens)
        self.model[request_id] = (replica, tokens)

    @rule(index=st.integers(0, 200))
    def release(self, index: int) -> None:
        expected = self.model.pop(f"r{index}", None)
        assert self.ledger.release(f"r{index}") == expected

    @rule(replicas=st.sets(st.sampled_from(["a", "b", "c", "d"])))
    def rediscover(self, replicas: set[str]) -> None:
        self.ledger.set_replicas(replicas)
        self.replicas = replicas
        self.model = {rid: charge for rid, charge in self.model.items() if charge[0] in replicas}

    @invariant()
    def counters_match_outstanding_charges(self) -> None:
        for replica in self.replicas:
            mine = [tokens for name, tokens in self.model.values() if name == replica]
            assert self.ledger.requests(replica) == len(mine)
            assert self.ledger.tokens(replica) == sum(mine)
        assert self.ledger.total_tokens() == sum(tokens for _, tokens in self.model.values())
        assert self.ledger.total_requests() == len(self.model) == self.ledger.in_flight()


TestLedgerMachine = LedgerMachine.TestCase
