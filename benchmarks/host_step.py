"""Host time of one engine step (CPU): a 128-token prompt arriving beside 64 decodes.

The model's forward is replaced by a no-op, and steps take the CUDA-graph input path
(built without capture on CPU), so what is timed is everything the host does per step:
planning, the runner's inputs (token ids, positions, slots, block tables, the staging
copy into the graph buffers), sampling and applying the sampled tokens.

    python benchmarks/host_step.py [--context 1024] [--decodes 64] [--trials 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _shared import emit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024, help="tokens of each decoding request's prompt")
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--speculative-method", choices=("ngram",), default=None,
                    help="with prompt lookup configured but every verify step predicted 100x too dear: what a "
                         "decision that says no costs a step (its shadow proposals included)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend's host side, on CPU (no kernel runs)
    import torch

    torch.set_num_threads(1)  # the host's work is one thread on a GPU too; CPU kernels would contend
    from expresslane.config import EngineConfig
    from expresslane.contract import EngineCoreRequest
    from expresslane.engine.core import EngineCore
    from expresslane.models.llama import LlamaForCausalLM
    from expresslane.runner.cuda_graphs import _Graphs
    from expresslane.sampling_params import SamplingParams

    # no forward (host work only): graph replays, and eager steps (the start-up calibration)
    _Graphs._replay = lambda self, size, rows: self.logits_out[:rows]
    LlamaForCausalLM.forward = lambda self, ids, positions, meta: torch.zeros(len(ids), self.config.hidden_size)
    spec = {} if args.speculative_method is None else {"speculative_method": args.speculative_method}
    config = EngineConfig.from_kwargs(attention_backend="triton", max_model_len=2048, device="cpu",
                                      scheduling_policy="fcfs", enable_prefix_caching=False, **spec)
    core = EngineCore(config)
    if core.spec is not None:  # measured verifies of every batch size at 100x their prediction: never pays
        core.spec._verify_scales = {bucket: 100.0 for bucket in range(1, 12)}
    core.runner.build_graphs(core.max_model_len, capture=False)
    core.runner.mixed_graphs.logits_out.zero_()
    greedy = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    for i in range(args.decodes):
        prompt = [(7 * i + j) % 2000 + 1 for j in range(args.context)]
        core.add_request(EngineCoreRequest(f"d{i}", prompt, greedy, (), time.monotonic()))
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                            for r in core.scheduler.running.values()):
        core.step()
    for _ in range(3):
        core.step()

    def timed_step() -> float:
        t0 = time.perf_counter()
        core.step()
        return time.perf_counter() - t0

    decode, mixed = [], []
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for t in range(args.trials):
        decode.append(timed_step())
        prompt = [(13 * t + j) % 2000 + 1 for j in range(args.prompt)]
        core.add_request(EngineCoreRequest(f"p{t}", prompt, one, (), time.monotonic()))
        mixed.append(timed_step())  # the prompt's step: its whole prefill beside the decodes
        assert core.stats().num_batched_tokens == args.prompt + args.decodes, core.stats()
        timed_step()  # its token lands; it finishes
    assert core.stats().spec_num_drafts == 0  # no step speculated
    emit(args.out, bench="host_step_cpu", context=args.context, decodes=args.decodes, prompt=args.prompt,
         speculative_method=args.speculative_method,
         mixed_step_us=round(statistics.median(mixed) * 1e6), decode_step_us=round(statistics.median(decode) * 1e6))


if __name__ == "__main__":
    main()
