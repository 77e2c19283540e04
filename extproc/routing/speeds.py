"""Each replica's speed, learnt online from the timings of its answers.

A replica's answer reports ``prompt_n`` tokens evaluated in ``prompt_ms`` and ``predicted_n``
tokens generated in ``predicted_ms`` (llama.cpp's ``timings``). Per replica:

- prefill: ``prompt_ms / 1000 = overhead_s + prompt_n × prefill_s_per_token``, fitted by least
  squares over exponentially weighted sums (weight ``ewma_weight`` for the newest answer, the older
  ones fading by ``1 - ewma_weight`` each), so the fit follows a replica that slows down;
- decode: the exponentially weighted mean of ``predicted_ms / predicted_n``.

Every replica starts from the configured prior, entered as two answers of weight ½ each (an
empty prompt and one of PRIOR_SPREAD_TOKENS), which fade like any other. Until its own answers
outweigh that prior (``trust_answers``: 14 at a weight of 0.05) a replica is taken to be as fast as
the fleet, the mean of the replicas past it: a prior far from the replicas' true speed (a CPU
prior on a GPU fleet) would otherwise mark a replica that answered a few short prompts, which fix
no slope, as the prior's speed, and the time decision would send it nothing more to learn from
(an H100 fleet of 16 left three replicas at ~200 tokens/s, starved). The times are measured
under whatever else the replica ran at the same moment, so the figures are its speed under its
usual load, not alone. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from mypy_extensions import mypyc_attr

# The prior's second answer: a prompt this long (two points fix a line: overhead and per-token time).
PRIOR_SPREAD_TOKENS = 512


class Speed(NamedTuple):
    prefill_s_per_token: float
    decode_s_per_token: float
    overhead_s: float  # fixed cost of a request's prefill, whatever its length


class AnswerTimings(NamedTuple):
    """What a replica reports of one answer (llama.cpp ``timings``)."""

    prompt_n: int  # prompt tokens evaluated (those not found cached)
    prompt_ms: float
    predicted_n: int  # tokens generated
    predicted_ms: float
    cache_n: int  # prompt tokens found cached


class _Fit:
    """One replica's weighted sums: weight, Σn, Σt, Σn², Σn·t (prefill) and the decode mean."""

    __slots__ = ("weight", "sum_n", "sum_t", "sum_nn", "sum_nt", "decode", "speed")

    def __init__(self, prior: Speed) -> None:
        spread = PRIOR_SPREAD_TOKENS
        low, high = prior.overhead_s, prior.overhead_s + spread * prior.prefill_s_per_token
        self.weight = 1.0
        self.sum_n = 0.5 * spread
        self.sum_t = 0.5 * (low + high)
        self.sum_nn = 0.5 * spread * spread
        self.sum_nt = 0.5 * spread * high
        self.decode = prior.decode_s_per_token
        self.speed = prior


@mypyc_attr(allow_interpreted_subclasses=True)
class ReplicaSpeeds:
    def __init__(self, prior: Speed, ewma_weight: float, learning: bool, replicas: Iterable[str] = ()) -> None:
        self.prior = prior
        self.ewma_weight = ewma_weight
        self.learning = learning
        # answers after which the prior weighs less than the answers, (1 - w)^n <= ½
        self.trust_answers = 1 if ewma_weight >= 1 else math.ceil(math.log(0.5) / math.log(1 - ewma_weight))
        self._fits: dict[str, _Fit] = {}
        self.answers: dict[str, int] = {}  # replica -> answers learnt from
        # of the trusted replicas (trust_answers or more), the one prefilling a prompt of
        # PRIOR_SPREAD_TOKENS soonest (ties: by name)
        self.fastest: str | None = None
        self.fleet = prior  # the mean of the trusted replicas' speeds (the prior until one is)
        self._sums = [0.0, 0.0, 0.0]  # of the trusted replicas' speeds, field by field
        self._trusted = 0  # replicas with trust_answers or more
        self.set_replicas(replicas)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Track exactly ``replicas``; a new (or returning) one starts from the prior."""
        wanted = set(replicas)
        for name in [name for name in self._fits if name not in wanted and self.trusted(name)]:
            self._add(self._fits[name].speed, -1)
            self._trusted -= 1
        self._mean()
        self._fits = {name: fit for name, fit in self._fits.items() if name in wanted}
        self.answers = {name: count for name, count in self.answers.items() if name in wanted}
        for name in wanted - self._fits.keys():
            self._fits[name] = _Fit(self.prior)
            self.answers[name] = 0
        self._find_fastest()

    def speed(self, replica: str) -> Speed:
        """The replica's learnt speed; until its answers outweigh the prior the fleet's
        (``fleet``): a replica little known is taken to be as fast as the others rather than
        as the prior, which would send every new conversation away from it (a replica just
        added, one never reached yet, one that answered only short prompts)."""
        fit = self._fits.get(replica)
        if fit is None:
            return self.prior
        return fit.speed if self.answers[replica] >= self.trust_answers else self.fleet

    def trusted(self, replica: str) -> bool:
        """Whether ``replica``'s own answers outweigh the prior (its learnt speed is used)."""
        return self.answers.get(replica, 0) >= self.trust_answers

    def speeds(self) -> dict[str, Speed]:
        return {name: self.speed(name) for name in sorted(self._fits)}

    def learn(self, replica: str, timings: AnswerTimings) -> None:
        """One answer of ``replica``; nonsense (negative or missing figures) is ignored."""
        fit = self._fits.get(replica)
        if fit is None or not self.learning:
            return
        learnt = False
        if timings.prompt_n > 0 and timings.prompt_ms >= 0:
            _add_prefill(fit, self.ewma_weight, float(timings.prompt_n), timings.prompt_ms / 1000)
            learnt = True
        if timings.predicted_n > 0 and timings.predicted_ms >= 0:
            keep = 1 - self.ewma_weight
            fit.decode = keep * fit.decode + self.ewma_weight * timings.predicted_ms / 1000 / timings.predicted_n
            learnt = True
        if learnt:
            before, fit.speed = fit.speed, _solve(fit)
            self.answers[replica] += 1
            if not self.trusted(replica):
                return
            if self.answers[replica] > self.trust_answers:
                self._add(before, -1)
            else:  # trusted from this answer on
                self._trusted += 1
            self._add(fit.speed, +1)
            self._mean()
            fastest = self.fastest
            if fastest is None:  # the first trusted replica
                self.fastest = replica
            elif fastest != replica:
                if (_reference_s(fit.speed), replica) < (_reference_s(self._fits[fastest].speed), fastest):
                    self.fastest = replica
            elif _reference_s(fit.speed) > _reference_s(before):  # the fastest slowed down
                self._find_fastest()

    def _find_fastest(self) -> None:
        """Among the trusted replicas (another takes the fleet's mean: never faster)."""
        trusted = [name for name in self.answers if self.trusted(name)]
        fits = self._fits
        self.fastest = min(trusted, key=lambda name: (_reference_s(fits[name].speed), name)) if trusted else None

    def _add(self, speed: Speed, sign: int) -> None:
        """Add (+1) or take away (-1) an answered replica's speed from the fleet's sums."""
        sums = self._sums
        for index, value in enumerate(speed):
            sums[index] += sign * value

    def _mean(self) -> None:
        trusted = self._trusted
        sums = self._sums
        self.fleet = Speed(sums[0] / trusted, sums[1] / trusted, sums[2] / trusted) if trusted else self.prior


def _reference_s(speed: Speed) -> float:
    """A replica's prefill of PRIOR_SPREAD_TOKENS: what ranks replicas by speed (the per-token time
    alone is ill-determined while the recent prompts were all of about one length)."""
    return speed.overhead_s + PRIOR_SPREAD_TOKENS * speed.prefill_s_per_token


def _add_prefill(fit: _Fit, weight: float, tokens: float, seconds: float) -> None:
    keep = 1 - weight
    fit.weight = keep * fit.weight + weight
    fit.sum_n = keep * fit.sum_n + weight * tokens
    fit.sum_t = keep * fit.sum_t + weight * seconds
    fit.sum_nn = keep * fit.sum_nn + weight * tokens * tokens
    fit.sum_nt = keep * fit.sum_nt + weight * tokens * seconds


def _solve(fit: _Fit) -> Speed:
    """The weighted least-squares line through the answers, overhead and slope both >= 0. When
    the recent prompts were all of one length the slope cannot be told apart from the overhead:
    the last slope stays and the overhead takes up the rest."""
    mean_n, mean_t = fit.sum_n / fit.weight, fit.sum_t / fit.weight
    variance = fit.sum_nn / fit.weight - mean_n * mean_n
    slope = fit.speed.prefill_s_per_token
    if variance > 1e-6 * mean_n * mean_n:
        slope = (fit.sum_nt / fit.weight - mean_n * mean_t) / variance
    overhead = mean_t - slope * mean_n
    if slope <= 0 or overhead < 0:  # a line through the origin: the time is all per token
        overhead, slope = 0.0, mean_t / mean_n
    return Speed(slope, fit.decode, overhead)
