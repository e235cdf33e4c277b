"""Adaptive draft length: pick, per round, the number of draft tokens that maximises committed
tokens per second of step time, from measured costs and acceptance rates; fall back to plain
decoding when speculation does not pay, probing now and then in case it starts to.

Model. With per-position acceptance probability a, a round drafting n tokens commits
E(n) = 1 + a + … + a^n tokens on average (the accepted prefix plus the target's own token). A
step is one forward over the rows of every sequence it advances (a plain decode row is 1 row, a
verify pass 1 + n); T(R), the seconds of a step of R rows, is learned per row count (typical
measured seconds, robust to one-off spikes; interpolated / extrapolated linearly between
measured counts), c, the drafter's seconds per draft token, likewise; a per request (seeded by
the rate across requests, which it also feeds). A sequence deciding its depth in a step whose
other rows number R_o and are expected to commit E_o tokens maximises the step's
(E_o + E(n)) / (T(R_o + 1 + n) + n·c): alone (R_o = E_o = 0) that is E(n) / (T(1 + n) + n·c); in a
big batch on a compute-bound machine T grows steeply with R and every draft row slows all the
others' tokens too, so drafts get shorter — found by measurement, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Rate:
    """Exponentially weighted acceptance rate: `hits / trials` with both decayed by `decay` per
    update (a prior enters as the initial counts and fades the same way)."""

    hits: float
    trials: float
    decay: float

    @property
    def value(self) -> float:
        return self.hits / self.trials if self.trials > 0 else 0.0

    def update(self, hits: int, trials: int) -> None:
        self.hits = self.decay * self.hits + hits
        self.trials = self.decay * self.trials + trials


# Samples after which a depth's own measurement is trusted over what the other depths predict.
TRUSTED_SAMPLES = 3


@dataclass
class Cost:
    """A timing's typical value (seconds); None until the first sample. A faster sample is taken at
    once, a slower one moves the estimate up by `weight` of the difference: on a shared machine
    noise only ever adds time, and one spike (a first use, a busy moment) at a rarely chosen depth
    would otherwise keep the controller away from that depth for a long time."""

    weight: float
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        if self.value is None or x < self.value:
            self.value = x
        else:
            self.value += self.weight * (x - self.value)
        self.count += 1


@dataclass
class StepShare:
    """The rest of a step when a sequence picks its draft depth: `rows` in the step's forward besides
    its own, expected to commit `tokens` (every undecided sequence counts as one plain row)."""

    rows: int = 0
    tokens: float = 0.0


@dataclass
class RequestDepth:
    """One request's controller state: its acceptance rate and its back-off schedule.

    plain_steps: plain steps since the last speculative round while backed off; probe_every: how
    many of them before the next probe (doubles after each probe that leaves plain decoding best).
    reproducible: decide from this request's own outcomes and the prior costs only, never from
    timings or other requests, so a seeded sampled request draws the same random numbers in the
    same order (hence the same tokens) on every run.
    """

    acceptance: Rate
    probe_every: int
    reproducible: bool = False
    plain_steps: int = 0
    probing: bool = False
    rounds: int = 0  # speculative rounds so far (every `explore_every`-th drafts one token more)


@dataclass
class DepthController:
    """Chooses draft lengths for every request of one engine (one target model, one drafter kind).

    max_depth: most draft tokens per verify pass. prior_acceptance: acceptance assumed before any
    measurement. cost_slope: prior extra step cost per row, as a fraction of a one-row step (until
    two row counts are measured). probe_every / max_probe_every: plain steps between probes while
    backed off, initially and at most. probe_depth: draft tokens of a probe. explore_every: every
    this many speculative rounds one draft token more than the best is tried, so that a depth whose
    cost was once mismeasured (a busy machine) is measured again. request_decay /
    global_decay: per-round decay of a request's / the cross-request acceptance counts (memory of
    about 1 / (1 - decay) rounds). cost_weight: how far a slower timing moves a cost estimate up
    (a faster one replaces it).
    """

    max_depth: int = 8
    prior_acceptance: float = 0.5
    cost_slope: float = 0.1
    probe_every: int = 16
    max_probe_every: int = 128
    probe_depth: int = 1
    explore_every: int = 16
    request_decay: float = 0.9
    global_decay: float = 0.98
    cost_weight: float = 0.1
    _steps: dict[int, Cost] = field(init=False, repr=False)  # seconds per step, by rows in it
    _draft: Cost = field(init=False, repr=False)  # drafter seconds per draft token
    _global: Rate = field(init=False, repr=False)  # acceptance across requests

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        self._steps = {}
        self._draft = Cost(self.cost_weight)
        self._global = Rate(self.prior_acceptance * 4, 4.0, self.global_decay)

    @property
    def acceptance(self) -> float:
        """Acceptance rate across requests (recent rounds weigh most)."""
        return self._global.value

    def start(self, reproducible: bool = False) -> RequestDepth:
        """State for a new request, seeded with the acceptance seen across requests (with the prior
        acceptance when `reproducible`)."""
        prior = self.prior_acceptance if reproducible else self._global.value
        return RequestDepth(
            Rate(prior * 2, 2.0, self.request_decay), self.probe_every, reproducible=reproducible
        )

    def measured_step_seconds(self) -> dict[int, float]:
        """Typical seconds of a step by its row count, for the counts measured."""
        return {r: m.value for r, m in sorted(self._steps.items())}

    def step_seconds(self, rows: int) -> float:
        """Estimated seconds of a step of `rows` rows (≥ 1), in the units of the measurements (1.0
        for one row before any). A count measured fewer than `TRUSTED_SAMPLES` times is estimated
        at most at what the other counts predict, so a spike there is tried again (and replaced by
        a faster sample) rather than avoided for good. Never more than a step with more rows was
        measured at: more rows cannot take less time, so a higher figure is noise."""
        known = {r: m.value for r, m in self._steps.items()}
        if rows in known:
            others = {r: v for r, v in known.items() if r != rows}
            if self._steps[rows].count >= TRUSTED_SAMPLES or len(others) < 2:
                estimate = known[rows]
            else:
                estimate = min(known[rows], self._predict(others, rows))
        else:
            estimate = self._predict(known, rows)
        return min([estimate, *(v for r, v in known.items() if r > rows)])

    def _predict(self, known: dict[int, float], n: int) -> float:
        """Seconds of a step of n rows from the measured counts `known`: linear between the nearest
        ones, extrapolated along the fitted slope beyond them."""
        if not known:
            return 1.0 + self.cost_slope * (n - 1)
        below = [d for d in known if d < n]
        above = [d for d in known if d > n]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (n - lo) / (hi - lo)
        base = max(below) if below else min(above)
        return max(known[base] + self._slope(known, base) * (n - base), 1e-9)

    def _slope(self, known: dict[int, float], base: int) -> float:
        """Seconds per extra row: a least-squares line through the measured counts, or the prior
        slope relative to the one measured count."""
        if len(known) < 2:
            return self.cost_slope * known[base] / (1.0 + self.cost_slope * (base - 1))
        xs, ys = list(known), list(known.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var, 0.0)

    @staticmethod
    def expected_tokens(n: int, acceptance: float) -> float:
        """E(n): tokens a round drafting n tokens commits on average (n = 0: a plain step's one)."""
        return sum(acceptance**i for i in range(n + 1))

    def rate(self, n: int, acceptance: float, measured: bool = True, share: StepShare | None = None) -> float:
        """Tokens per second (in measurement units) the step commits when this sequence drafts n
        tokens beside `share` (None: alone); with `measured` False from the prior costs of a step
        alone (a plain step 1, no drafting cost)."""
        expected = self.expected_tokens(n, acceptance)
        if not measured:
            return expected / (1.0 + self.cost_slope * n)
        share = share or StepShare()
        draft = (self._draft.value or 0.0) * n
        return (share.tokens + expected) / (self.step_seconds(share.rows + 1 + n) + draft)

    def depth(self, state: RequestDepth, limit: int, share: StepShare | None = None) -> int:
        """Draft tokens for this request's next round (0: a plain decode step); `limit` caps it
        (tokens left before max_tokens); `share`: the rest of the step it joins (None: alone). A
        reproducible request ignores `share` (its depths depend on its own outcomes only)."""
        limit = min(limit, self.max_depth)
        if limit < 1:
            return 0
        a = state.acceptance.value
        measured = not state.reproducible
        best = max(range(limit + 1), key=lambda n: (self.rate(n, a, measured, share), -n))
        probed, state.probing = state.probing, False
        if best > 0:
            state.plain_steps = 0
            state.probe_every = self.probe_every  # paying again: probe soon should it stop paying
            state.rounds += 1
            return min(best + 1, limit) if state.rounds % self.explore_every == 0 else best
        if probed:  # the probe did not make speculation pay: wait longer before the next
            state.probe_every = min(state.probe_every * 2, self.max_probe_every)
        state.plain_steps += 1
        if state.plain_steps < state.probe_every:
            return 0
        state.plain_steps = 0
        state.probing = True
        return min(self.probe_depth, limit)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows (plain decode rows and verify rows, of every sequence it advanced)
        took `seconds`, from its forward to the last of its tokens being sampled."""
        self._steps.setdefault(rows, Cost(self.cost_weight)).add(seconds)

    def observe_round(
        self, state: RequestDepth, drafted: int, judged: int, accepted: int, draft_seconds: float
    ) -> None:
        """A round drafted `drafted` tokens (≥ 1) in `draft_seconds`; `judged` of them were compared
        with the target (not those after the first rejection or a stop), the first `accepted` were
        accepted. (The step it ran in is reported with `observe_step`.)"""
        state.acceptance.update(accepted, judged)
        self._global.update(accepted, judged)
        self._draft.add(draft_seconds / drafted)
