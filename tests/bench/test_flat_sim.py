"""benchmarks/flat_sim.py's pipelined simulation: steps as the engine runs them (simulated time)."""

from __future__ import annotations

import pytest

from expresslane.config import SchedulerConfig
from expresslane.cost_model.piecewise import PiecewiseStepCostModel

STEP = 0.1
FLAT = PiecewiseStepCostModel([1, 4096], [STEP, STEP])  # every step 100 ms, whatever it computes


def test_the_next_step_is_planned_a_margin_before_the_one_running_ends(flat_sim):
    """A prompt's step runs [0, 100 ms]; the next is planned at 100 ms - the margin: a request
    arriving just before that plan is in it (first token at 200 ms), one arriving just after waits
    for the step after (300 ms). Each of a request's tokens lands when its step ends."""
    fcfs = {"scheduling_policy": "fcfs"}
    plan_at = STEP - SchedulerConfig().step_hold_margin_ms / 1e3
    sent = [flat_sim.request("a", 64, 3, 0.0), flat_sim.request("in", 16, 1, plan_at - 1e-4),
            flat_sim.request("late", 16, 1, plan_at + 1e-4)]
    times = flat_sim.simulate(fcfs, sent, FLAT)
    assert times["a"] == pytest.approx([STEP, 2 * STEP, 3 * STEP])
    assert times["in"] == pytest.approx([2 * STEP])
    assert times["late"] == pytest.approx([3 * STEP])


def test_an_idle_engine_starts_a_request_when_it_arrives(flat_sim):
    times = flat_sim.simulate({"scheduling_policy": "fcfs"},
                              [flat_sim.request("a", 16, 2, 0.0), flat_sim.request("b", 16, 1, 5.0)], FLAT)
    assert times["a"] == pytest.approx([STEP, 2 * STEP]) and times["b"] == pytest.approx([5.0 + STEP])
