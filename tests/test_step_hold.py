"""The engine plans the next step shortly before the one on the GPU is predicted to end (no
wall clock: the step on the GPU is a stand-in whose end is set far away or has come)."""

import pytest

from expresslane.contract import StepPlan
from expresslane.config import SchedulerConfig
from expresslane.engine.core import _InFlight
from expresslane.cost_model.base import StepShape


class OnGpu:
    """A launched step's result that has or has not ended."""

    prompt_logprobs = None

    def __init__(self, ended: bool):
        self.ended = ended
        self.prompt_logprobs = None

    def ready(self) -> bool:
        return self.ended

    def get(self):
        return {}, None

    def pooled(self):
        return None


def in_flight(ended: bool, ends: float, speculative: bool = False) -> _InFlight:
    return _InFlight(StepPlan(-1, [], 0), OnGpu(ended), StepShape(2048, has_prefill=True), 0, ends=ends,
                     speculative=speculative)


@pytest.fixture
def core(llama_dir):
    from expresslane import LLM

    return LLM(str(llama_dir), max_model_len=256, max_num_seqs=8).engine.core


def test_hold_lasts_until_the_step_on_the_gpu_nears_its_predicted_end(core):
    core._host_s = 0.01  # planning and launching take 10 ms: the margin is 3 of them
    assert core.hold(in_flight(False, ends=100.0), now=99.0) == pytest.approx(1.0 - 0.03)
    assert core.hold(in_flight(False, ends=100.0), now=99.98) == 0.0  # within the margin: plan now
    core._host_s = 0.0
    assert core.hold(in_flight(False, ends=100.0), now=99.0) == pytest.approx(1.0 - SchedulerConfig().step_hold_margin_ms / 1e3)
    assert core.hold(in_flight(True, ends=100.0), now=99.0) == 0.0  # it has ended
    assert core.hold(in_flight(False, ends=100.0, speculative=True), now=99.0) == 0.0  # lands first
    assert core.hold(in_flight(False, ends=0.0), now=99.0) == 0.0  # no prediction (synchronous launches)
    assert core.hold(None, now=99.0) == 0.0


def test_a_held_call_launches_nothing_and_a_later_one_plans_with_what_arrived(core, llama_dir):
    import time

    from expresslane.contract import EngineCoreRequest
    from expresslane.sampling_params import SamplingParams

    calls = core._calls
    core._in_flight = gpu = in_flight(False, ends=time.monotonic() + 60.0)
    core.add_request(EngineCoreRequest("late", [1, 2, 3], SamplingParams(max_tokens=2), (0,), 0.0))
    assert core.step() == [] and core.held
    assert core._calls == calls and core.scheduler.num_waiting == 1 and core._in_flight is gpu
    stats = core.stats()  # a turn that ran no model (the metrics skip it), with the gauges as they are now
    assert stats.batch_size == 0 and stats.step_duration == 0.0 and stats.num_waiting == 1
    gpu.result.ended = True
    core.step()
    assert not core.held and core._calls == calls + 1 and core.scheduler.num_waiting == 0
    assert core._in_flight is not gpu
