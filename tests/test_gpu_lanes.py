"""Issue #45 on CUDA: the two lanes' steps on disjoint SMs (one driver split per split the policy
may choose). The split's halves run on the SMs they were given, a CUDA graph replayed on a half
stays on it only if it was captured there, and the engine's greedy tokens with the lanes on their
SMs equal transformers'."""

import pytest
import torch
from models import build_model, hf_greedy

from expresslane import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPIN_NS = 20_000  # each probe program holds its SM this long, so the programs spread out


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def smid_probe(out_ptr, spin_ns):
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        t = t0
        while t - t0 < spin_ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)
    return smid_probe


def test_split_halves_are_disjoint_and_a_graph_stays_on_its_half():
    from expresslane.runner.sm_partitions import SmPartitions

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel = _probe_kernel()
    out = torch.full((8 * total,), -1, device=dev, dtype=torch.int32)
    kernel[(out.numel(),)](out, SPIN_NS, num_warps=1)  # compiled and loaded in the primary context
    torch.cuda.synchronize()
    parts = SmPartitions(dev, [48])

    def ran_on(stream, launch) -> set[int]:
        out.fill_(-1)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            launch()
        stream.synchronize()
        return set(out.tolist()) - {-1}

    def probe():
        kernel[(out.numel(),)](out, SPIN_NS, num_warps=1)

    decode, prefill = (ran_on(parts.stream(lane, 48), probe) for lane in ("decode", "prefill"))
    print(f"granted {parts.granted[48]}; decode kernels on {len(decode)} SMs, prefill on {len(prefill)}")
    assert not decode & prefill
    assert (len(decode), len(prefill)) == parts.granted[48]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probe()
    replayed = ran_on(parts.stream("decode", 48), graph.replay)
    print(f"a graph captured in the primary context, replayed on the decode half: {len(replayed)} SMs")
    on_half = torch.cuda.CUDAGraph()
    with torch.cuda.graph(on_half, stream=parts.stream("decode", 48)):
        probe()
    there = ran_on(parts.stream("decode", 48), on_half.replay)
    elsewhere = ran_on(torch.cuda.Stream(), on_half.replay)
    print(f"a graph captured on the decode half's stream: replayed there on {len(there)} SMs, on a primary "
          f"stream on {len(elsewhere)}")
    assert there <= decode and elsewhere <= decode  # hence the decode lane's graphs, captured per split


LONG = [[(11 * i + 5 * j) % 500 for j in range(n)] for i, n in enumerate((700, 400, 1300, 260, 900))]
SHORT = [[(7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((1, 17, 64, 33, 90, 5, 48, 12))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_two_lanes_on_their_own_sms_match_transformers(tmp_path, monkeypatch):
    """Long prompts (over the prefill cap of 128) in the prefill lane beside shorts decoding:
    some steps run on a split's halves at once, and every request's tokens equal transformers'.
    Penalised requests (penalty state both lanes' steps share) equal lanes off."""
    from expresslane.runner.sm_partitions import SmPartitions

    model_dir = build_model("llama", tmp_path / "llama", max_position_embeddings=2048)
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=512, max_model_len=2048)
    llm = LLM(str(model_dir), pd_lanes="on", **kw)
    parts = llm.engine.core.runner.partitions
    assert parts is not None, "the lanes should be bound to SM partitions on this GPU"
    seen = []
    running = SmPartitions.running

    def spy(self, lane, sms, carried):
        seen.append((lane, sms))
        return running(self, lane, sms, carried)

    monkeypatch.setattr(SmPartitions, "running", spy)
    prompts = [p for pair in zip(LONG, SHORT) for p in pair] + SHORT[len(LONG):]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    mismatched = [i for i, (o, p) in enumerate(zip(outs, prompts))
                  if o.outputs[0].token_ids != hf_greedy(model_dir, p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    split = {sms for lane, sms in seen if lane == "prefill" and sms}
    assert split and any(lane == "decode" and sms in split for lane, sms in seen), seen
    graphs = llm.engine.core.runner.decode_graphs
    assert set(graphs.placed) == {0, *parts.granted} and all(graphs.placed[n] for n in parts.granted)
    penalised = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5)]
    mixed = [LONG[2], SHORT[3]]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in mixed], penalised,
                                                        use_tqdm=False)]
    off = LLM(str(model_dir), **kw)
    want = [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": p} for p in mixed], penalised,
                                                         use_tqdm=False)]
    assert got == want
