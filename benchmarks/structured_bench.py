"""Issue #39's sampling-control figures, in the engine (no HTTP): a json_schema-constrained
decode's and a penalized decode's time per output token against the same decode plain, at batch
1 and 64, and grammar compilation (a 10-field schema, cold and cached).

    python benchmarks/structured_bench.py --model DIR [--only plain] [--out results.jsonl]

``--only plain`` runs the plain decode alone, with nothing newer than SamplingParams: point
PYTHONPATH at an older tree to time the same decode before these controls existed.

Both runs generate the same number of tokens: the constrained one's schema is one long string
field, so the model writes until the output is closed near its budget's end; TPOT is each
request's (finished - first token) / (tokens - 1), the median over the batch, for the
constrained run divided by its own token count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _shared import emit, prompts_of

TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TEN_FIELDS = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                               for i in range(10)}, "required": [f"field_{i}" for i in range(10)]}


def tpot_ms(outs) -> float:
    per = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    return statistics.median(per) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=("plain",), default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from expresslane import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=128, gpu_memory_utilization=0.85, load_format="dummy")
    core = llm.engine.core
    vocab = core.hf_config.vocab_size
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(2, 32, vocab)], SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    if args.only == "plain":
        for batch in (1, 64):
            prompts = [{"prompt_token_ids": p} for p in prompts_of(batch, 32, vocab, seed=batch)]
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            best = min(tpot_ms(llm.generate(prompts, params, use_tqdm=False)) for _ in range(args.repeats))
            emit(args.out, bench="plain_tpot", label=args.label, batch=batch, tpot_ms=round(best, 3))
        return

    from expresslane.sampling_params import StructuredOutputs

    constrained = StructuredOutputs(json=json.dumps(TEXT_SCHEMA))
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(2, 32, vocab)],
                 SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained), use_tqdm=False)
    for batch in (1, 64):
        prompts = [{"prompt_token_ids": p} for p in prompts_of(batch, 32, vocab, seed=batch)]
        rows = {}
        for label, so in (("plain", None), ("json_schema", constrained)):
            runs = []
            for _ in range(args.repeats):
                params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=so is None,
                                        structured_outputs=so)
                outs = llm.generate(prompts, params, use_tqdm=False)
                runs.append((tpot_ms(outs), statistics.median(len(o.outputs[0].token_ids) for o in outs)))
            rows[label] = min(runs)
        ratio = rows["json_schema"][0] / rows["plain"][0]
        emit(args.out, bench="structured_tpot", batch=batch, plain_tpot_ms=round(rows["plain"][0], 3),
             json_schema_tpot_ms=round(rows["json_schema"][0], 3), json_schema_tokens=rows["json_schema"][1],
             ratio=round(ratio, 4), target="<= 1.05")
        penalized = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, presence_penalty=0.5,
                                   frequency_penalty=0.5, repetition_penalty=1.1)
        best = min(tpot_ms(llm.generate(prompts, penalized, use_tqdm=False)) for _ in range(args.repeats))
        emit(args.out, bench="penalties_tpot", batch=batch, plain_tpot_ms=round(rows["plain"][0], 3),
             penalized_tpot_ms=round(best, 3), ratio=round(best / rows["plain"][0], 4), target="<= 1.03")

    grammars = core.grammars
    t0 = time.perf_counter()
    grammars.compiled(StructuredOutputs(json=json.dumps(TEN_FIELDS))).result()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compiled(StructuredOutputs(json=json.dumps(TEN_FIELDS))).result()
    cached = time.perf_counter() - t0
    emit(args.out, bench="grammar_compile", fields=10, cold_ms=round(cold * 1e3, 2), cached_ms=round(cached * 1e3, 3),
         target="<= 50 ms cold, 0 cached")


if __name__ == "__main__":
    main()
