"""Teacher-forced top-1 agreement of expresslane (bf16, GPU kernels) with transformers (bf16).

    python benchmarks/bf16_agreement.py --model DIR [--num-seqs 8 --seq-len 512] [--held-out-code]

Both models read the same token sequences in one forward pass (random ids, or with
--held-out-code the held-out stdlib files a model of the built-in pair never saw, in
windows of --seq-len tokens: real next-token distributions); at every
position the argmax of the next-token logits is compared. Also reported: agreement
on positions where transformers' top-2 logit margin exceeds 1% of its logit range
(a near-tie can flip on any bf16 rounding difference). Control, same positions:
transformers bf16 and expresslane bf16 each against transformers float32: how often
bf16 rounding alone moves the argmax, for the reference itself.
"""

from __future__ import annotations

import argparse
import random

import torch
from _shared import emit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--held-out-code", action="store_true", help="held-out stdlib code instead of random ids")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from expresslane import LLM
    from expresslane.bench.inprocess import random_prompts
    from expresslane.contract import NewRequest, ScheduledSeq, StepPlan
    from expresslane.sampling_params import SamplingParams

    llm = LLM(args.model, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
    runner = llm.engine.runner  # one forward through its own input path
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    hf32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    hf_vs_32 = ours_vs_32 = 0
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    agree = total = agree_clear = total_clear = 0
    if args.held_out_code:
        from expresslane.bench.code_corpus import stdlib_files

        tok = llm.engine.tokenizer
        stream = [t for _, text in stdlib_files("held-out") for t in tok.encode(text)]
        seqs = [stream[i * args.seq_len:(i + 1) * args.seq_len] for i in range(len(stream) // args.seq_len)]
        seqs = seqs[:args.num_seqs]
    else:
        seqs = [random_prompts(rng, vocab, [args.seq_len])[0] for _ in range(args.num_seqs)]
    with torch.inference_mode():
        for ids in seqs:
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
            top1_32 = hf32(torch.tensor([ids], device="cuda")).logits[0].argmax(-1)
            blocks = list(range(-(-len(ids) // runner.block_size)))  # the engine is idle: any blocks will do
            plan = StepPlan(0, [ScheduledSeq("agree", ids, 0, blocks, False)], len(ids),
                            [NewRequest("agree", SamplingParams())])
            input_ids, positions, meta = runner._prepare(runner.rows.apply(plan))
            runner.release(["agree"])
            ours = runner.model.compute_logits(runner.model(input_ids, positions, meta))
            same = ours.argmax(-1) == ref.argmax(-1)
            hf_vs_32 += int((ref.argmax(-1) == top1_32).sum())
            ours_vs_32 += int((ours.argmax(-1) == top1_32).sum())
            top2 = ref.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.01 * (ref.max(-1).values - ref.min(-1).values)
            agree += int(same.sum())
            total += same.numel()
            agree_clear += int(same[clear].sum())
            total_clear += int(clear.sum())
    row = dict(bench="bf16_top1_agreement", model=args.model.rstrip("/").split("/")[-1],
               text="held-out code" if args.held_out_code else "random ids", positions=total,
               agreement=agree / total, clear_positions=total_clear,
               agreement_clear=agree_clear / max(1, total_clear), control_hf_bf16_vs_fp32=hf_vs_32 / total,
               ours_bf16_vs_hf_fp32=ours_vs_32 / total)
    emit(args.out, **row)


if __name__ == "__main__":
    main()
