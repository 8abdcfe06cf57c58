"""Issue #45's scenarios in-process (no HTTP), for engine configurations started one after
another on this machine: `pd_lanes on` (the lanes on SM partitions where the GPU allows) against
the default and fcfs.

    python benchmarks/pd_lanes_bench.py --model DIR --dtype bfloat16 \
        --config default= --config fcfs=scheduling_policy:fcfs --config pd=pd_lanes:on

Per configuration, a fresh engine, then:
  beside-long  `--num-short` shorts (`--short-len` in, `--output-len` out) as one burst, alone;
               then one `--long-len` prompt and, `--lead-ms` later, the burst again. Repeated
               `--repeats` times; the long prompt alone as often. Short TTFT, total time and
               inter-token p99 (from the host times each token was seen), the long one's TTFT.
  mixed        Poisson arrivals at `--rate` for `--duration` s, `--long-fraction` of them long:
               short TTFT p50/p99, short inter-token p99, long TTFT p50.
  isolated     batch-1 inter-token time (the mixed ratio's denominator).
The engine is stepped in this thread; arrivals are added between steps, at their times or as
soon after as a step returns (as the server's loop does). One JSON line per configuration, a table
with the issue's bars last.
"""

from __future__ import annotations

import argparse
import random
import time

from _shared import emit
from flat_sim import number

from expresslane.bench.inprocess import random_prompts, release_memory
from expresslane.bench.stats import distribution


def parse_config(text: str) -> tuple[str, dict]:
    """NAME=key:value,key:value (engine arguments; ints and floats parsed)."""
    name, _, rest = text.partition("=")
    pairs = (item.partition(":") for item in filter(None, rest.split(",")))
    return name, {key: number(value) for key, _, value in pairs}


class Driver:
    """One engine, stepped here; each request's token times as the host saw them."""

    def __init__(self, llm, args):
        from expresslane import SamplingParams

        self.eng, self.args = llm.engine, args
        self.sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.rng = random.Random(args.seed)
        self.vocab = llm.engine.core.hf_config.vocab_size
        self.times: dict[str, list[float]] = {}
        self.arrived: dict[str, float] = {}
        self.n = 0

    def add(self, length: int, tag: str) -> str:
        rid = f"{tag}-{self.n}"
        self.n += 1
        [ids] = random_prompts(self.rng, self.vocab, [length])
        self.arrived[rid] = time.monotonic()
        self.eng.add_request(rid, {"prompt_token_ids": ids}, self.sp)
        self.times[rid] = []
        return rid

    def step(self) -> None:
        outs = self.eng.step()
        now = time.monotonic()
        for o in outs:
            self.times[o.request_id].append(now)

    def run(self, arrivals: list[tuple[float, int, str]]) -> list[str]:
        """Arrivals (seconds from now, length, tag), stepping until every request finished."""
        t0, ids, pending = time.monotonic(), [], sorted(arrivals)
        while pending or self.eng.has_unfinished():
            now = time.monotonic() - t0
            while pending and pending[0][0] <= now:
                _, length, tag = pending.pop(0)
                ids.append(self.add(length, tag))
            if self.eng.has_unfinished():
                self.step()
            else:
                time.sleep(max(0.0, pending[0][0] - now))
        return ids

    def ttft(self, rid: str) -> float:
        return self.times[rid][0] - self.arrived[rid]

    def total(self, rid: str) -> float:
        return self.times[rid][-1] - self.arrived[rid]

    def gaps(self, rid: str) -> list[float]:
        t = self.times[rid]
        return [b - a for a, b in zip(t, t[1:])]


def ms(values: list[float], stat: str) -> float:
    return distribution(values)[stat] if values else float("nan")


def beside_long(d: Driver, a) -> dict:
    burst = [(0.0, a.short_len, "short")] * a.num_short
    alone, beside, longs, long_alone = [], [], [], []
    for _ in range(a.repeats):
        alone += d.run(burst)
        ids = d.run([(0.0, a.long_len, "long")] + [(a.lead_ms / 1e3, a.short_len, "short")] * a.num_short)
        longs.append(ids[0])
        beside += ids[1:]
    for _ in range(a.repeats):
        long_alone += d.run([(0.0, a.long_len, "long")])

    def shorts(ids):
        return dict(ttft=ms([d.ttft(r) for r in ids], "p50"), total=ms([d.total(r) for r in ids], "p50"),
                    itl_p50=ms([g for r in ids for g in d.gaps(r)], "p50"),
                    itl_p99=ms([g for r in ids for g in d.gaps(r)], "p99"))
    out = dict(alone=shorts(alone), beside=shorts(beside), long_ttft_ms=ms([d.ttft(r) for r in longs], "p50"),
               long_alone_ttft_ms=ms([d.ttft(r) for r in long_alone], "p50"))
    out["short_ttft_ratio"] = out["beside"]["ttft"] / out["alone"]["ttft"]
    out["short_total_ratio"] = out["beside"]["total"] / out["alone"]["total"]
    out["long_ratio"] = out["long_ttft_ms"] / out["long_alone_ttft_ms"]
    return out


def mixed(d: Driver, a, itl_batch1_ms: float) -> dict:
    rng, t, arrivals = random.Random(a.seed + 1), 0.0, []
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.duration:
            break
        long = rng.random() < a.long_fraction
        arrivals.append((t, a.long_len if long else a.short_len, "long" if long else "short"))
    ids = d.run(arrivals)
    shorts = [r for r in ids if r.startswith("short")]
    longs = [r for r in ids if r.startswith("long")]
    itl_p99 = ms([g for r in shorts for g in d.gaps(r)], "p99")
    return dict(requests=len(ids), longs=len(longs), short_ttft_p50=ms([d.ttft(r) for r in shorts], "p50"),
                short_ttft_p99=ms([d.ttft(r) for r in shorts], "p99"), short_itl_p99=itl_p99,
                long_ttft_p50=ms([d.ttft(r) for r in longs], "p50"), itl_ratio=itl_p99 / itl_batch1_ms)


def run_config(name: str, kw: dict, a) -> dict:
    from expresslane import LLM

    t0 = time.monotonic()
    llm = LLM(a.model, dtype=a.dtype, **kw)
    startup = time.monotonic() - t0
    core = llm.engine.core
    a.long_len = min(a.long_len, llm.config.model.max_model_len - a.output_len)  # as the doctor cuts it to fit
    bound = getattr(core.runner, "partitions", None)
    d = Driver(llm, a)
    d.run([(0.0, a.long_len, "warm")] + [(0.0, a.short_len, "warm")] * 4)  # first-use costs
    [one] = d.run([(0.0, a.short_len, "one")])
    itl1 = ms(d.gaps(one), "p50")
    row = dict(config=name, engine_args=kw, long_len=a.long_len, startup_s=startup,
               partitions=bound.describe() if bound else None,
               itl_batch1_ms=itl1, ttft_short_alone_ms=ms([d.ttft(one)], "p50"))
    if "beside-long" in a.run:
        row["beside_long"] = beside_long(d, a)
    if "mixed" in a.run:
        row["mixed"] = mixed(d, a, itl1)
    del llm, core, d
    release_memory()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--config", action="append", default=None, help="NAME=key:value,... (repeatable)")
    ap.add_argument("--run", default="beside-long,mixed")
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--lead-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--long-fraction", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for c in a.config or ["default=", "pd=pd_lanes:on"]:
        try:
            rows.append(emit(a.out, bench="pd_lanes", **run_config(*parse_config(c), a)))
        except Exception as e:  # noqa: BLE001 - the other configurations still run
            print(f"{c}: failed: {type(e).__name__}: {e}", flush=True)
            release_memory()
    print(f"\n{'config':<10}{'SMs d/p':>18}{'short TTFT x':>13}{'total x':>9}{'long x':>8}{'long ms':>9}"
          f"{'| mix ITL99 x':>13}{'TTFT99 ms':>10}{'long p50':>10}")
    for r in rows:
        b, m = r.get("beside_long", {}), r.get("mixed", {})
        print(f"{r['config']:<10}{str(r['partitions'] or '-')[:18]:>18}{b.get('short_ttft_ratio', float('nan')):>13.2f}"
              f"{b.get('short_total_ratio', float('nan')):>9.2f}{b.get('long_ratio', float('nan')):>8.2f}"
              f"{b.get('long_ttft_ms', float('nan')):>9.1f}{m.get('itl_ratio', float('nan')):>13.2f}"
              f"{m.get('short_ttft_p99', float('nan')):>10.1f}{m.get('long_ttft_p50', float('nan')):>10.1f}")
    print("bars (issue #45): short TTFT <= 1.1x, total <= 1.2x, long <= 1.3x; mixed ITL p99 <= 1.5x, "
          "long TTFT p50 <= 300 ms")


if __name__ == "__main__":
    main()
