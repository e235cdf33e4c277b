"""The depth controller on simulated rounds: deep drafts when they are accepted and verification is
cheap, plain decoding (with rare probes) when drafts are never accepted or drafting costs too much,
reproducible decisions for seeded requests."""

from __future__ import annotations

import random

from hybridlm.speculative import DepthController, StepShare


def simulate(controller, steps, acceptance, verify_cost, draft_cost=0.0, seed=0, state=None):
    """Decode `steps` rounds; drafts are accepted position by position with probability
    `acceptance`; a verify pass with n drafts costs verify_cost(n) seconds, drafting n tokens
    n·draft_cost. Returns the depth of every round (0: plain step)."""
    rng = random.Random(seed)
    state = state or controller.start()
    depths = []
    for _ in range(steps):
        n = controller.depth(state, limit=100)
        depths.append(n)
        if n == 0:
            controller.observe_step(1, verify_cost(0))
            continue
        accepted = 0
        while accepted < n and rng.random() < acceptance:
            accepted += 1
        judged = min(accepted + 1, n)
        controller.observe_round(state, n, judged, accepted, n * draft_cost)
        controller.observe_step(1 + n, verify_cost(n))
    return depths


def test_accepted_drafts_and_cheap_verification_draft_deep():
    controller = DepthController(max_depth=8)
    depths = simulate(controller, 60, acceptance=1.0, verify_cost=lambda n: 1.0 + 0.05 * n)
    assert depths[-40:] == [8] * 40


def test_never_accepted_drafts_back_off_to_plain_decoding_with_rare_probes():
    controller = DepthController(max_depth=8)
    depths = simulate(controller, 600, acceptance=0.0, verify_cost=lambda n: 1.0 + 0.1 * n)
    rounds = [i for i, n in enumerate(depths) if n > 0]
    assert len(rounds) <= 14, rounds  # a few rounds to learn, then probes at doubling intervals
    gaps = [b - a for a, b in zip(rounds[-4:], rounds[-3:], strict=False)]
    assert min(gaps) >= 64
    extra = sum(0.1 * depths[i] for i in rounds) / len(depths)  # cost above plain decoding
    assert extra < 0.02


def test_probes_bring_speculation_back_when_drafts_start_to_pay():
    controller = DepthController(max_depth=8)
    state = controller.start()
    simulate(controller, 100, acceptance=0.0, verify_cost=lambda n: 1.0 + 0.1 * n, state=state)
    depths = simulate(controller, 300, acceptance=0.95, verify_cost=lambda n: 1.0 + 0.1 * n, state=state)
    assert sum(n > 0 for n in depths[-50:]) == 50


def test_expensive_drafting_backs_off_and_moderate_acceptance_drafts_shallow():
    costly = DepthController(max_depth=8)
    depths = simulate(costly, 200, acceptance=0.9, verify_cost=lambda n: 1.0 + 0.05 * n, draft_cost=1.0)
    assert sum(n > 0 for n in depths[-100:]) <= 5
    moderate = DepthController(max_depth=8)
    depths = simulate(moderate, 300, acceptance=0.7, verify_cost=lambda n: 1.0 + 0.3 * n)
    assert 1 <= sorted(depths[-100:])[50] <= 4  # the best is 2 (1.37 tokens per plain-step time)


def test_seeded_requests_decide_from_their_own_outcomes_only():
    """Other requests and measured timings change the controller's shared state; a reproducible
    request's depths depend only on its own accept / reject history."""
    runs = []
    for noise_seed in (1, 2):
        controller = DepthController(max_depth=8)
        simulate(controller, 50, acceptance=noise_seed / 3, verify_cost=lambda n, s=noise_seed: s + n)
        runs.append(simulate(controller, 80, 0.7, lambda n: 1.0, seed=9, state=controller.start(True)))
    assert runs[0] == runs[1]


def test_one_slow_verify_pass_does_not_keep_the_controller_shallow():
    """A spike (a first use, a busy moment) at the best depth must not make it avoid that depth."""
    controller = DepthController(max_depth=8)
    state = controller.start()
    spiked = iter([True])
    cost = lambda n: (5.0 if n == 8 and next(spiked, False) else 1.0) + 0.05 * n  # noqa: E731
    depths = simulate(controller, 60, acceptance=1.0, verify_cost=cost, state=state)
    assert depths[-40:] == [8] * 40


def simulate_batch(controller, sequences, steps, acceptance, step_cost, seed=0):
    """`sequences` requests decode together for `steps` steps, as the engine runs them: each picks its
    depth in turn for a step holding the others' rows (every undecided one a plain row); a step of R
    rows costs step_cost(R) seconds (a fake clock). Returns every depth of the last half."""
    rng = random.Random(seed)
    states = [controller.start() for _ in range(sequences)]
    depths = []
    for _ in range(steps):
        step = StepShare(sequences, float(sequences))
        chosen = []
        for state in states:
            n = controller.depth(state, 100, StepShare(step.rows - 1, step.tokens - 1.0))
            step.rows += n
            step.tokens += controller.expected_tokens(n, state.acceptance.value) - 1.0
            chosen.append(n)
        controller.observe_step(step.rows, step_cost(step.rows))
        for state, n in zip(states, chosen, strict=True):
            if n:
                accepted = 0
                while accepted < n and rng.random() < acceptance:
                    accepted += 1
                controller.observe_round(state, n, min(accepted + 1, n), accepted, 0.0)
        depths += chosen
    return depths[len(depths) // 2 :]


def test_drafts_shorten_when_the_batch_makes_rows_expensive():
    """Compute-bound steps (each row costs 30% of a one-row step): a sequence alone drafts 2-3, eight
    together decode plainly (a draft row slows every other sequence's token); memory-bound steps
    (a row costs 2% of a step) keep drafting deep at any batch size. Learned from the step times."""
    compute_bound = lambda rows: 1.0 + 0.3 * (rows - 1)  # noqa: E731
    memory_bound = lambda rows: 1.0 + 0.02 * (rows - 1)  # noqa: E731
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    alone = simulate_batch(DepthController(max_depth=8), 1, 200, 0.7, compute_bound)
    batched = simulate_batch(DepthController(max_depth=8), 8, 200, 0.7, compute_bound)
    assert median(alone) >= 2
    assert median(batched) == 0 and sum(batched) < 0.1 * sum(alone) * 8
    cheap = simulate_batch(DepthController(max_depth=8), 8, 200, 0.7, memory_bound)
    assert median(cheap) >= 3


def test_a_batch_does_not_change_a_seeded_requests_depths():
    """A reproducible request decides from its own outcomes only, batch or not."""
    controller = DepthController(max_depth=8)
    state = controller.start(reproducible=True)
    alone = [controller.depth(state, 8) for _ in range(5)]
    controller = DepthController(max_depth=8)
    for rows in range(1, 40):
        controller.observe_step(rows, rows * 1.0)
    state = controller.start(reproducible=True)
    crowded = [controller.depth(state, 8, StepShare(30, 30.0)) for _ in range(5)]
    assert alone == crowded


def test_a_step_is_never_estimated_above_a_faster_step_with_more_rows():
    """On a shared machine noise only adds time: a busy moment measured at 2 rows must not make 2
    rows look dearer than 4."""
    controller = DepthController()
    for _ in range(3):
        controller.observe_step(1, 1.0)
        controller.observe_step(2, 5.0)
        controller.observe_step(4, 1.3)
    assert controller.step_seconds(2) == 1.3
    assert controller.step_seconds(1) == 1.0
