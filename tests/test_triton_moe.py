"""The fused MoE path (routing, align by expert, two grouped GEMMs; Triton's interpreter on CPU) against
the torch reference, on fresh random inputs: odd expert counts, top-1 and top-2, rows routed
nowhere (expert parallelism's -1), experts no row reaches, every tile size."""

import pytest
import torch

fused_moe = pytest.importorskip("expresslane.layers.fused_moe")

from expresslane.layers.moe import route, torch_experts  # noqa: E402
from expresslane.quant.int4_experts import Int4Experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _inputs(seed: int, tokens: int, experts: int, k: int, hidden: int, inter: int, dtype, drop: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = route(torch.randn(tokens, experts, generator=g) * 2, k, renormalize=k > 1)
    if drop:  # some rows belong to no expert here
        ids = torch.where(torch.rand(ids.shape, generator=g) < drop, -1, ids)
    return [t.to(dtype) for t in (x, w13, w2)] + [weights, ids]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k,drop,hidden,inter", [  # every tile of fused_moe._tiles: rows per
    (1, 5, 2, 0.0, 96, 80), (7, 7, 1, 0.0, 96, 80), (33, 5, 2, 0.3, 96, 80),  # expert, and decode's by K
    (90, 3, 2, 0.0, 96, 80), (130, 3, 2, 0.0, 96, 80), (300, 3, 1, 0.5, 96, 80), (800, 3, 1, 0.0, 96, 80),
    (2, 3, 2, 0.0, 2048, 40), (1, 3, 1, 0.0, 40, 4100)])
def test_fused_experts_match_reference(dtype, tokens, experts, k, drop, hidden, inter):
    x, w13, w2, weights, ids = _inputs(tokens, tokens, experts, k, hidden, inter, dtype=dtype, drop=drop)
    ref = torch_experts(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu().float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out, ref, atol=tol, rtol=tol), (out - ref).abs().max()
    if drop:  # a token whose rows all go nowhere gets zeros
        nowhere = (ids < 0).all(1)
        assert torch.equal(out[nowhere], torch.zeros_like(out[nowhere]))


@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_groups_rows_by_expert(block_m):
    g = torch.Generator().manual_seed(block_m)
    ids = torch.randint(-1, 6, (40, 2), generator=g)
    ids[:, 1] = torch.where(ids[:, 1] == 4, 5, ids[:, 1])  # expert 4: only from slot 0
    rows, block_expert, used = (t.cpu() for t in fused_moe.align_by_expert(ids.to(DEVICE), 6, block_m))
    flat = ids.flatten()
    assert rows.shape[0] % block_m == 0 and rows.shape[0] == block_expert.shape[0] * block_m
    assert int(used) % block_m == 0 and int(used) <= rows.shape[0]
    seen = []
    for tile in range(int(used) // block_m):
        tile_rows = rows[tile * block_m:(tile + 1) * block_m]
        real = tile_rows[tile_rows < flat.numel()].long()
        assert (flat[real] == block_expert[tile]).all()  # a tile holds one expert's rows
        seen += real.tolist()
    assert sorted(seen) == sorted((flat >= 0).nonzero().flatten().tolist())  # each routed row once
    assert int(used) == sum(-(-int((flat == e).sum()) // block_m) * block_m for e in range(6))


@pytest.mark.parametrize("experts,k,renormalize", [(5, 2, True), (7, 1, False), (128, 8, True), (3, 3, False)])
def test_fused_route_matches_reference(experts, k, renormalize):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(37, experts, generator=g) * 3
    slots = torch.arange(37)
    slots[-5:] = -1  # CUDA-graph padding: routed, not counted
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE)
    weights, ids = fused_moe.fused_route(logits.to(DEVICE), k, renormalize, counts, slots.to(DEVICE))
    ref_w, ref_ids = route(logits, k, renormalize)
    assert torch.equal(ids.cpu().long(), ref_ids)
    assert torch.allclose(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(counts.cpu(), torch.bincount(ref_ids[:-5].flatten(), minlength=experts))


def test_fused_route_scales_as_deepseek_greedy_routing():
    """DeepSeek-V2's greedy routing (softmax, top k unrenormalised, times routed_scaling_factor)
    through the fused kernel: the same experts and weights as route_deepseek."""
    from expresslane.layers.deepseek_moe import Routing, route_deepseek

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(21, 64, generator=g) * 2
    counts = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    weights, ids = fused_moe.fused_route(logits.to(DEVICE), 6, False, counts, torch.arange(21).to(DEVICE), scale=16.0)
    ref_w, ref_ids = route_deepseek(logits, 6, Routing("greedy", 1, 1, False, 16.0), None)
    order = ref_ids.sort(-1)
    assert torch.equal(ids.cpu().long().sort(-1).values, order.values)
    assert torch.allclose(weights.cpu().gather(1, ids.cpu().long().sort(-1).indices), ref_w.gather(1, order.indices),
                          atol=1e-5, rtol=1e-5)
    assert int(counts.sum()) == 21 * 6


def test_engine_counts_real_tokens_only(model_dirs):
    """Through the CUDA-graph input path (run eagerly on CPU), padded decode batches and mixed
    steps route padding tokens too; the counters take only the real ones: every computed
    token x top-k per layer, none from start-up (profiling, calibration)."""
    from expresslane import LLM, SamplingParams

    llm = LLM(str(model_dirs["mixtral"]), attention_backend="triton", max_num_batched_tokens=48, max_num_seqs=6,
              max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.build_graphs(llm.config.model.max_model_len, capture=False)
    padded = []
    real_run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda inputs, patch: (padded.append(len(inputs.seqs)), real_run(inputs, patch))[1]
    prompts = [[(5 * i + j) % 500 for j in range(n)] for i, n in enumerate((3, 20, 33))]  # 3 decodes: padded to 4
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5,
                                                                            ignore_eos=True), use_tqdm=False)
    assert 3 in padded, padded  # decode graphs of bucket 4 ran with one padding sequence
    computed = sum(len(p) for p in prompts) + 3 * 4
    counts = llm.engine.core.expert_tokens
    assert sorted(counts) == [0, 1] and all(sum(row) == computed * 2 for row in counts.values()), counts


def _int4_experts(w: torch.Tensor, fmt: str, group: int):
    """Float experts [E, N, K] as Int4Experts, through each expert's checkpoint tensors."""
    from expresslane.quant.int4 import Int4Method, awq_tensors, gptq_tensors

    method = Int4Method(fmt, group, zero_offset=1 if fmt == "gptq" else 0)
    experts, n, k = w.shape
    packed = Int4Experts(experts, n, k, method)
    for e in range(experts):
        for name, t in (awq_tensors if fmt == "awq" else gptq_tensors)(w[e], group).items():
            packed.load(e, slice(0, n), name, t)
    return packed


@pytest.mark.parametrize("fmt,group", [("awq", 32), ("gptq", 128)])
@pytest.mark.parametrize("tokens,experts,k,drop", [(1, 5, 2, 0.0), (33, 5, 2, 0.3), (300, 3, 1, 0.0)])
def test_fused_int4_experts_match_reference(fmt, group, tokens, experts, k, drop):
    """The grouped GEMMs dequantizing INT4 in-kernel (groups wider and narrower than a K tile)
    equal the reference on the same experts, and float experts holding the dequantized weights."""
    x, w13, w2, weights, ids = _inputs(tokens, tokens, experts, k, hidden=128, inter=128, dtype=torch.float32,
                                       drop=drop)
    q13, q2 = _int4_experts(w13, fmt, group), _int4_experts(w2, fmt, group)
    ref = torch_experts(x, q13, q2, weights, ids)
    dense = torch.stack([q13[e] for e in range(experts)]), torch.stack([q2[e] for e in range(experts)])
    assert torch.allclose(ref, torch_experts(x, *dense, weights, ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, torch_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)  # 4 bits: lossy
    out = fused_moe.fused_experts(*(t.to(DEVICE) for t in (x, q13.to(DEVICE), q2.to(DEVICE), weights, ids)))
    err = (out.cpu() - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


# -- gpt-oss: top-k then softmax, biases, the clamped SwiGLU ------------------------------------
def _gpt_oss_reference(x, w13, w2, b13, b2, weights, ids, act):
    """transformers' GptOssExperts' computation, written out: per chosen expert, gate|up with bias,
    the clamped SwiGLU, down with bias, times the routing weight."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            if e < 0:
                continue
            gate, up = (w13[e] @ x[t] + b13[e]).chunk(2)
            gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
            out[t] += (w2[e] @ ((up + 1) * gate * torch.sigmoid(gate * act.alpha)) + b2[e]) * w
    return out


@pytest.mark.parametrize("tokens,experts,k,drop", [(1, 5, 2, 0.0), (33, 5, 4, 0.3), (300, 3, 1, 0.0)])
def test_fused_gpt_oss_experts_match_reference(tokens, experts, k, drop):
    from expresslane.layers.moe import ClampedSwiGLU

    x, w13, w2, _, ids = _inputs(tokens, tokens, experts, k, 96, 80, torch.float32, drop)
    g = torch.Generator().manual_seed(tokens + 1)
    x = x * 3  # gate and up values past the limit: the clamps bind
    b13, b2 = torch.randn(experts, 160, generator=g), torch.randn(experts, 96, generator=g)
    weights, ids2 = route(torch.randn(tokens, experts, generator=g), k, False, topk_softmax=True)
    ids = torch.where(ids < 0, -1, ids2)  # (the dropped rows stay dropped)
    act = ClampedSwiGLU(alpha=1.702, limit=2.0)
    exact = _gpt_oss_reference(x, w13, w2, b13, b2, weights, ids, act)
    assert (w13[:, :80] @ x.T).abs().max() > act.limit and (w13[:, 80:] @ x.T).min() < -act.limit
    ref = torch_experts(x, w13, w2, weights, ids, b13, b2, act)
    assert torch.allclose(ref, exact, atol=1e-4, rtol=1e-4)
    out = fused_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), b13=b13.to(DEVICE),
                                  b2=b2.to(DEVICE), act=act)
    assert torch.allclose(out.cpu(), exact, atol=1e-4, rtol=1e-4), (out.cpu() - exact).abs().max()


@pytest.mark.parametrize("experts,k", [(5, 2), (32, 4), (3, 3)])
def test_fused_topk_softmax_route(experts, k):
    """gpt-oss's routing: the k largest logits (best first), softmax over them alone."""
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(37, experts, generator=g) * 3
    top, ref_ids = torch.topk(logits, k)
    ref_w = torch.softmax(top, -1)
    weights, ids = route(logits, k, False, topk_softmax=True)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_w)
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE)
    fw, fids = fused_moe.fused_route(logits.to(DEVICE), k, False, counts, torch.arange(37).to(DEVICE),
                                     topk_softmax=True)
    assert torch.equal(fids.cpu().long(), ref_ids)
    assert torch.allclose(fw.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(counts.cpu(), torch.bincount(ref_ids.flatten(), minlength=experts))


@pytest.mark.parametrize("tokens,experts,k,drop,one_row", [(1, 5, 2, 0.0, False), (33, 5, 4, 0.3, False),
                                                           (300, 3, 1, 0.0, False), (2, 5, 2, 0.3, True)])
def test_fused_mxfp4_experts_match_reference(tokens, experts, k, drop, one_row, monkeypatch):
    """The grouped GEMMs decoding MXFP4 in-kernel (every code and sign, scales above and below 1)
    equal the reference on the dequantized experts, with gpt-oss's biases and SwiGLU; `one_row`:
    through tiles of one row (no tensor cores), rows on other ranks (-1) left zero."""
    monkeypatch.setattr(fused_moe, "MX4_TILES",  # one-row tiles, else the tensor-core tiles at every row count
                        (fused_moe.Tiles(1, 32, 64, 4), fused_moe.Tiles(1, 16, 64, 4)) if one_row else None)
    from expresslane.layers.moe import ClampedSwiGLU
    from expresslane.quant.mxfp4 import Mxfp4Experts

    x, _, _, weights, ids = _inputs(tokens, tokens, experts, k, 96, 64, torch.float32, drop)
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = Mxfp4Experts(experts, 128, 96), Mxfp4Experts(experts, 96, 64)
    for w in (w13, w2):
        w.blocks.data = torch.randint(0, 256, w.blocks.shape, dtype=torch.uint8, generator=g)
        w.scales.data = torch.randint(118, 129, w.scales.shape, dtype=torch.uint8, generator=g)  # 2^-9 .. 2^1
    b13, b2 = torch.randn(experts, 128, generator=g) * 0.1, torch.randn(experts, 96, generator=g) * 0.1
    act = ClampedSwiGLU(limit=3.0)
    dense = [torch.stack([w[e] for e in range(experts)]) for w in (w13, w2)]
    ref = torch_experts(x, *dense, weights, ids, b13, b2, act)
    assert torch.allclose(torch_experts(x, w13, w2, weights, ids, b13, b2, act), ref)
    out = fused_moe.fused_experts(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                                  b13=b13.to(DEVICE), b2=b2.to(DEVICE), act=act)
    # float32 sums in another order: errors relative to the outputs' scale (hundreds here)
    assert torch.allclose(out.cpu(), ref, atol=2e-6 * ref.abs().max(), rtol=1e-4), (out.cpu() - ref).abs().max()



@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's scaled dot runs on CUDA only (not in the interpreter)")
@pytest.mark.parametrize("tokens", [16, 300])
def test_mxfp4_scaled_dot_equals_the_kernels_own_decode(tokens, monkeypatch):
    """MX4_DOT's products (Triton's scaled dot) in bf16, on MX4_DOT_TILES' tiles, equal the kernel's
    own decode and dots (16 tokens: 12.8 rows an expert, in the kernel) and the experts decoded whole
    (300 tokens: 240 rows an expert, 128-row tiles under the scaled dot)."""
    from expresslane.layers.moe import ClampedSwiGLU
    from expresslane.quant.mxfp4 import Mxfp4Experts

    x, _, _, weights, ids = _inputs(tokens, tokens, 5, 4, 256, 128, torch.bfloat16, 0.0)
    g = torch.Generator().manual_seed(7)
    w13, w2 = Mxfp4Experts(5, 256, 256), Mxfp4Experts(5, 256, 128)
    for w in (w13, w2):
        w.blocks.data = torch.randint(0, 256, w.blocks.shape, dtype=torch.uint8, generator=g)
        w.scales.data = torch.randint(118, 129, w.scales.shape, dtype=torch.uint8, generator=g)
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    args = (x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    act = ClampedSwiGLU(limit=7.0)
    monkeypatch.setattr(fused_moe, "MX4_DOT", False)
    ref = fused_moe.fused_experts(*args, act=act).float()
    monkeypatch.setattr(fused_moe, "MX4_DOT", True)
    out = fused_moe.fused_experts(*args, act=act).float()
    assert torch.allclose(out, ref, atol=2e-2 * ref.abs().max(), rtol=2e-2), (out - ref).abs().max()

def test_mxfp4_experts_decode_whole_exactly():
    """dequantize_experts (the path for many rows an expert) equals the reference decode bit for
    bit, over a width that is not a multiple of its tile, every code, scales from 2^-125 up (the
    smallest values normal in bf16: the interpreter flushes bf16 subnormals)."""
    from expresslane.quant.mxfp4 import Mxfp4Experts

    g = torch.Generator().manual_seed(5)
    w = Mxfp4Experts(3, 70, 288)
    w.blocks.data = torch.randint(0, 256, w.blocks.shape, dtype=torch.uint8, generator=g)
    w.scales.data = torch.randint(2, 140, w.scales.shape, dtype=torch.uint8, generator=g)
    ref = torch.stack([w[e] for e in range(3)])
    for dtype in (torch.float32, torch.bfloat16):
        out = fused_moe.dequantize_experts(w.to(DEVICE), dtype).cpu()
        assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
