"""The step-cost model on synthetic timings (no wall clock): fit, predict, invert, refine."""

import random

import numpy as np
import pytest

from expresslane.cost_model.base import StepShape
from expresslane.cost_model.piecewise import PiecewiseStepCostModel, NominalStepCostModel
from expresslane.runner.step_timing import calibration_steps

# The H200 8B shape's linear layers (issue #20): flat while memory-bound, then compute-bound.
H200_LINEAR = {16: 3.9e-3, 64: 4.2e-3, 128: 4.4e-3, 256: 5.6e-3, 512: 9.5e-3}


def h200_step(shape: StepShape, scale: float = 1.0) -> float:
    t = shape.num_tokens
    knots = sorted(H200_LINEAR)
    if t >= knots[-1]:
        linear = H200_LINEAR[512] + (t - 512) * (9.5e-3 - 5.6e-3) / 256
    else:
        linear = float(np.interp(t, knots, [H200_LINEAR[k] for k in knots]))
    attention = 2e-9 * shape.decode_context + 1e-12 * shape.prefill_pairs
    return scale * (linear + attention + (0.3e-3 if shape.has_prefill else 0.0))


def calibration(truth=h200_step) -> list[tuple[StepShape, float]]:
    steps = calibration_steps(2048, 256, 100_000, 16, 8192)
    return [(StepShape.of(s), truth(StepShape.of(s))) for s in steps]


def random_shapes(rng: random.Random, n: int) -> list[StepShape]:
    shapes = []
    for _ in range(n):
        chunks = [(rng.randint(1, 4000), 1) for _ in range(rng.randint(0, 64))]
        if rng.random() < 0.5 or not chunks:
            chunks.append((rng.randint(0, 4000), rng.randint(2, 1500)))
        shapes.append(StepShape.of(chunks))
    return shapes


def test_shape_counts_tokens_context_and_pairs():
    shape = StepShape.of([(10, 1), (20, 1), (100, 4)])
    assert shape.num_tokens == 6
    assert shape.decode_context == 11 + 21  # a decode reads its context and its own token
    assert shape.prefill_pairs == 4 * 100 + (1 + 2 + 3 + 4)
    assert shape.has_prefill
    assert StepShape.of([(5, 1)]).plus_chunk(100, 4) == StepShape(5, 6, shape.prefill_pairs, True)
    assert not StepShape.of([(5, 1)]).has_prefill


def test_fit_recovers_the_step_times_it_was_calibrated_on():
    model = PiecewiseStepCostModel.fit(calibration(), max_tokens=2048)
    for shape in random_shapes(random.Random(0), 300):
        assert model.predict(shape) == pytest.approx(h200_step(shape), rel=0.05)
    assert model.k_decode == pytest.approx(2e-9, rel=0.1)


def test_linear_part_never_decreases_and_attention_terms_are_not_negative():
    rng = random.Random(1)
    noisy = [(s, t * rng.uniform(0.8, 1.25)) for s, t in calibration(lambda s: 1e-3 + 1e-6 * s.num_tokens)]
    model = PiecewiseStepCostModel.fit(noisy, max_tokens=2048)
    assert np.all(np.diff(model.token_times) >= 0)
    assert model.k_decode >= 0 and model.k_prefill >= 0
    times = [model.predict(StepShape(n)) for n in range(1, 2049, 7)]
    assert times == sorted(times)


def test_max_chunk_is_the_largest_chunk_within_the_target():
    model = PiecewiseStepCostModel.fit(calibration(), max_tokens=2048)
    decodes = StepShape.of([(1000, 1)] * 16)
    target = 4.6e-3  # a TPOT target a little above a 16-decode step's 3.9 ms + attention
    n = model.max_chunk(decodes, start=2000, limit=8192, target=target)
    assert 0 < n < 256  # prefill rides in the slack: tens to a couple hundred tokens, not thousands
    assert model.predict(decodes.plus_chunk(2000, n)) <= target
    assert model.predict(decodes.plus_chunk(2000, n + 1)) > target
    assert model.max_chunk(decodes, 2000, limit=10, target=target) == 10
    assert model.max_chunk(decodes, 2000, limit=8192, target=1e-4) == 0


BUCKETS = (8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)  # a mixed-graph family's sizes


def bucketed_step(shape: StepShape) -> float:
    """A machine whose steps with prefill run padded to `BUCKETS` (the mixed CUDA graphs)."""
    t = shape.num_tokens
    if shape.has_prefill and t <= BUCKETS[-1]:
        t = min(b for b in BUCKETS if b >= t)
    return h200_step(StepShape(t, shape.decode_context, shape.prefill_pairs, shape.has_prefill))


def test_a_step_with_prefill_costs_its_padded_bucket():
    """Fitted on a machine that pads steps with prefill (the H200: one decode beside a 136- and
    a 200-token chunk took the same 8.7 ms, bucket 256), the model predicts the bucket's cost,
    where interpolating between knots under-predicted it; and the largest chunk within a target
    fills its bucket: the target pays for those tokens anyway."""
    samples = [(s, bucketed_step(s)) for s, _ in calibration()]
    padded = PiecewiseStepCostModel.fit(samples, max_tokens=2048, padded=BUCKETS)
    plain = PiecewiseStepCostModel.fit(samples, max_tokens=2048)
    decodes = StepShape.of([(100, 1)] * 8)
    for n in (9, 57, 129, 200, 247, 300, 700, 1500):  # 1500 + 8 tokens: past the buckets, unpadded
        shape = decodes.plus_chunk(0, n)
        assert padded.predict(shape) == pytest.approx(bucketed_step(shape), rel=0.02)
    assert plain.predict(decodes.plus_chunk(0, 129)) < 0.9 * bucketed_step(decodes.plus_chunk(0, 129))
    assert padded.predict(decodes) == pytest.approx(h200_step(decodes), rel=0.02)  # decodes: unpadded
    target = bucketed_step(decodes.plus_chunk(0, 129)) * 1.001  # bucket 256's cost
    assert padded.max_chunk(decodes, 0, 8192, target) == 256 - 8
    again = PiecewiseStepCostModel.from_dict(padded.to_dict())
    assert again.padded == BUCKETS and again.predict(decodes.plus_chunk(0, 129)) == padded.predict(
        decodes.plus_chunk(0, 129))


def two_paths(shape: StepShape) -> float:
    """A machine whose mixed path (steps with prefill, bucketed) costs more than its decode path
    by 2.5 ms at a few tokens and less the more tokens, none from 512 on (where the matmuls
    dominate both): not a constant apart, as on the H200."""
    if not shape.has_prefill:
        return h200_step(shape)
    return bucketed_step(shape) + 2.5e-3 * max(0.0, 1.0 - shape.num_tokens / 512)


def test_decodes_alone_keep_their_own_curve_under_a_mixed_load():
    """Fitted on a machine whose two paths differ by more than a constant, and refitted on a mixed
    load's steps (8-16 decodes beside 40-500-token chunks, the H200 replay's kind), the model
    predicts decodes alone and mixed steps alike: each path has its curve. (With one curve and a
    constant, such refits moved 64 tokens from 6.3 to 8.1 ms on the H200.)"""
    rng = random.Random(3)
    samples = [(s, two_paths(s)) for s, _ in calibration()]
    model = PiecewiseStepCostModel.fit(samples, max_tokens=2048, padded=BUCKETS)
    model.refit_every = 256
    for _ in range(512):
        shape = StepShape.of([(rng.randint(60, 8000), 1) for _ in range(rng.randint(8, 16))]).plus_chunk(
            rng.randint(0, 6000), rng.choice((rng.randint(40, 110), rng.randint(150, 500))))
        model.observe(shape, two_paths(shape))
    assert model.refits >= 1
    for n in (1, 9, 16, 100):
        decodes = StepShape.of([(500, 1)] * n)
        assert model.predict(decodes) == pytest.approx(two_paths(decodes), rel=0.03)
    mixed = StepShape.of([(500, 1)] * 9).plus_chunk(3000, 247)
    assert model.predict(mixed) == pytest.approx(two_paths(mixed), rel=0.05)
    again = PiecewiseStepCostModel.from_dict(model.to_dict())
    assert again.predict(mixed) == model.predict(mixed) and again.predict(decodes) == model.predict(decodes)


def test_a_model_of_one_curve_and_a_constant_is_two_curves():
    """A model written with one curve and a mixed-path constant (by hand, or published by an
    older engine: `c_mixed` in its dict) predicts as it always did."""
    old = {"knots": [1, 256], "token_times": [1e-3, 3e-3], "k_decode": 0.0, "k_prefill": 0.0, "c_mixed": 0.5e-3}
    model = PiecewiseStepCostModel.from_dict(old)
    assert model.predict(StepShape(128)) == pytest.approx(1e-3 + 2e-3 * 127 / 255)
    assert model.predict(StepShape(128, has_prefill=True)) == pytest.approx(model.predict(StepShape(128)) + 0.5e-3)


def test_observed_steps_refine_the_model_toward_the_machine_it_runs_on():
    model = PiecewiseStepCostModel.fit(calibration(), max_tokens=2048)
    model.refit_every = 64
    rng = random.Random(2)
    probe = StepShape.of([(500, 1)] * 32)
    before = model.predict(probe)
    for shape in random_shapes(rng, 512):  # the machine is busier than at start-up: 1.5x slower
        model.observe(shape, h200_step(shape, scale=1.5))
    assert model.num_observed == 512
    assert model.predict(probe) == pytest.approx(1.5 * before, rel=0.1)


def test_a_refit_that_predicts_worse_is_not_kept():
    """Stalls (a step held up 100x by something else on the machine) are not the step's cost:
    the least-squares refit bends toward them, predicts the samples worse, and is dropped."""
    model = PiecewiseStepCostModel.fit(calibration(), max_tokens=2048)
    model.refit_every = 16
    probe = StepShape.of([(500, 1)] * 32)
    before = model.predict(probe)
    stalled = StepShape.of([(100, 1)] * 4)
    for _ in range(16):
        model.observe(stalled, 100 * h200_step(stalled))
    assert model.num_observed == 16
    assert model.predict(probe) == before


def test_sizes_past_the_calibrated_ones_follow_the_last_segment():
    """A light (CPU) calibration stops at 256 tokens: bigger steps are not free."""
    samples = [(StepShape(n), 1e-3 + 1e-5 * n) for n in (1, 16, 64, 128, 256)]
    model = PiecewiseStepCostModel.fit(samples, max_tokens=2048)
    assert model.predict(StepShape(2048)) == pytest.approx(1e-3 + 1e-5 * 2048, rel=0.01)
    assert model.predict(StepShape(512)) > model.predict(StepShape(256))


def test_fit_needs_samples():
    with pytest.raises(ValueError, match="no samples"):
        PiecewiseStepCostModel.fit([])


def test_calibration_steps_fit_the_engine_limits():
    for light in (False, True):
        steps = calibration_steps(budget=512, max_seqs=8, num_blocks=200, block_size=16, max_model_len=1024,
                                  light=light)
        assert steps
        for step in steps:
            assert sum(n for _, n in step) <= 512 and len(step) <= 8
            assert all(s + n < 1024 for s, n in step)
            assert sum(-(-(s + n) // 16) for s, n in step) <= 200


def test_engine_calibrates_at_start_and_times_the_steps_it_runs(llama_dir):
    from expresslane import LLM, SamplingParams

    llm = LLM(str(llama_dir), max_model_len=256, max_num_seqs=8, step_cost_model="calibrate")
    core = llm.engine.core
    assert core.cost_model.predict(StepShape(64)) > 0
    llm.generate(["a b c"] * 4, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    # every step of a busy engine ran right behind the one before: each was timed and predicted
    assert core.cost_model.num_observed >= 10
    stats = core.stats()
    assert stats.step_time > 0 and stats.predicted_step_time > 0


def test_engine_starts_with_a_tiny_kv_cache(llama_dir):
    from expresslane import LLM

    llm = LLM(str(llama_dir), num_kv_blocks=2, max_model_len=16, max_num_batched_tokens=8)
    assert llm.engine.core.cost_model.predict(StepShape(1)) >= 0


def test_a_fixed_model_is_nominal_or_read_from_a_file_and_never_refits(tmp_path):
    from expresslane.cost_model.registry import make_cost_model

    def calibrate():
        raise AssertionError("a fixed model times nothing")

    nominal = make_cost_model("nominal", 2048, calibrate)
    assert nominal.to_dict() == NominalStepCostModel(2048).to_dict()
    fitted = PiecewiseStepCostModel([1, 64, 512], [4e-3, 5e-3, 9e-3], k_decode=2e-9, k_prefill=1e-12)
    path = tmp_path / "h200.json"
    path.write_text(__import__("json").dumps(fitted.to_dict()))
    loaded = make_cost_model(str(path), 2048, calibrate)
    assert loaded.to_dict() == fitted.to_dict()
    for model in (nominal, loaded):
        before = model.to_dict()
        for _ in range(1000):  # steps four times slower than predicted
            model.observe(StepShape(64), 4 * model.predict(StepShape(64)))
        assert model.to_dict() == before and model.refits == 0


def test_a_step_cost_model_that_cannot_be_read_is_a_clear_error(tmp_path):
    from expresslane.cost_model.registry import make_cost_model

    bad = tmp_path / "bad.json"
    bad.write_text('{"knots": [1]}')
    for choice in (str(tmp_path / "missing.json"), str(bad)):
        with pytest.raises(ValueError, match="--step-cost-model"):
            make_cost_model(choice, 2048, lambda: None)


def test_the_engine_takes_the_configured_model_and_calibrates_only_when_asked(llama_dir):
    from expresslane import LLM

    llm = LLM(str(llama_dir), max_model_len=64, step_cost_model="nominal")
    assert llm.engine.core.cost_model.to_dict() == NominalStepCostModel(2048).to_dict()


def test_the_engine_takes_a_model_handed_in(llama_dir):
    """A cost model value (not a name) is the engine's as given: a test fixes its decisions."""
    from expresslane import LLM

    fixed = PiecewiseStepCostModel([1, 64, 512], [4e-3, 5e-3, 9e-3], k_decode=2e-9, k_prefill=1e-12)
    llm = LLM(str(llama_dir), max_model_len=64, step_cost_model=fixed)
    assert llm.engine.core.cost_model is fixed

