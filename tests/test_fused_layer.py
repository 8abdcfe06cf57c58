"""The fused decode layer (``fused_decode_layer``): each fused GEMV variant against torch, and a
tiny Llama's decode with the switch on against the switch off (Triton's interpreter on CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from expresslane.layers.fused_gemv import fused_config, fused_gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's dots have no 16-bit floats: float32 there (exact-precision dot), bf16 on a GPU
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ROWS = [1, 3, 8]
SPLITS = [1, 3]  # one program per tile; an uneven split over 3 programs (the last of 3 K-slices is short)


def _counters_clear():
    from expresslane.device import arrival_counters
    assert int(arrival_counters(torch.device(DEVICE)).abs().sum()) == 0  # every tile's last program reset its counter


def _tensors(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) * 0.1
    res = torch.randn(m, n, generator=g)
    return x, w, bias, res


def _check(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """float32: sums in another order (bound ~ K ulps of |x| @ |w|); bf16: the output's rounding."""
    tol = 2**-7 if DTYPE == torch.bfloat16 else 2**-16
    assert got.shape == want.shape and got.dtype == DTYPE
    err = (got.float().cpu() - want).abs()
    assert (err <= scale * tol + tol).all(), float(err.max())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_norm_folded_into_the_gemv(m, split):
    """RMSNorm with its weight folded into W's columns: (x @ (W g)^T) * rsqrt(mean(x^2) + eps)
    against norm(x) @ W^T with the weight applied to x; N odd (a masked edge tile), K not a
    multiple of the tile (masked last step), a bias after the scale (Qwen2's qkv)."""
    k, n, eps = 320, 77, 1e-5
    x, w, bias, _ = _tensors(m, k, n, seed=10 + m)
    gamma = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    want = normed @ w.t() + bias
    got = fused_gemv(x.to(DEVICE, DTYPE), (w * gamma).to(DEVICE, DTYPE), bias.to(DEVICE, DTYPE), norm_eps=eps,
                     block_n=32, block_k=64, split=split)
    _check(got, want, normed.abs() @ w.abs().t() + bias.abs())
    _counters_clear()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_residual_added_in_the_epilogue(m, split):
    """o_proj's form: x @ W^T + residual, with N odd and K a whole number of tiles."""
    k, n = 256, 45
    x, w, _, res = _tensors(m, k, n, seed=20 + m)
    want = x @ w.t() + res
    got = fused_gemv(x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), residual=res.to(DEVICE, DTYPE), block_n=32,
                     block_k=64, split=split)
    _check(got, want, x.abs() @ w.abs().t() + res.abs())
    _counters_clear()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_silu_and_mul_in_the_prologue(m, split):
    """down's form: silu(gate) * up of gate|up [M, 2K], then @ W^T + residual."""
    k, n = 192, 33
    gate_up, _, _, _ = _tensors(m, 2 * k, 1, seed=30 + m)
    _, w, bias, res = _tensors(m, k, n, seed=40 + m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    want = act @ w.t() + bias + res
    got = fused_gemv(gate_up.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), bias.to(DEVICE, DTYPE), silu=True,
                     residual=res.to(DEVICE, DTYPE), block_n=32, block_k=64, split=split)
    _check(got, want, act.abs() @ w.abs().t() + bias.abs() + res.abs())
    _counters_clear()


def test_default_tiles_split_and_agree_with_one_program():
    """down's default split (several K-slices, from fused_config) against SPLIT = 1 on the same inputs."""
    k, n = 1024, 64
    gate_up, w, _, res = _tensors(3, 2 * k, n, seed=50)
    args = (gate_up.to(DEVICE, DTYPE), w[:, :k].contiguous().to(DEVICE, DTYPE))
    assert fused_config(n, silu=True)["split"] is None and fused_config(n, silu=False)["split"] == 1
    one = fused_gemv(*args, silu=True, residual=res.to(DEVICE, DTYPE), split=1)
    many = fused_gemv(*args, silu=True, residual=res.to(DEVICE, DTYPE))
    _check(many, one.float().cpu(), one.float().cpu().abs())
    _counters_clear()


def test_rejects_what_it_cannot_run():
    x = torch.zeros(17, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fused_gemv(x, torch.zeros(8, 64, device=DEVICE, dtype=DTYPE))
    with pytest.raises(ValueError, match="does not fit"):
        fused_gemv(x[:2], torch.zeros(8, 64, device=DEVICE, dtype=DTYPE), silu=True)


# --- the whole layer: a tiny model's decode step, switch on against switch off ---

def _tiny_model(model_dir, seed: int):
    """The model of `model_dir` on the triton backend, its norm weights random (the fold must
    move them), and the backend."""
    from expresslane.attention.registry import get_backend
    from expresslane.models.loader import iter_weights
    from expresslane.models.model_dir import load_hf_config
    from expresslane.models.registry import model_class

    cfg = load_hf_config(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    backend = get_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                          torch.device(DEVICE), DTYPE)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # as the runner builds it (the rotary table stays float32)
    try:
        with torch.device(DEVICE):
            model = model_class(cfg)(cfg, backend)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_weights(model_dir, torch.device(DEVICE)))
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    return model.eval(), backend, head_dim


def _decode_step(model, backend, head_dim: int, lens: list[int], seed: int):
    """One decode step of len(lens) seqs over random cached context (the cache's other
    slots): the final-normed hidden states and the caches the step wrote into."""
    from expresslane.attention.backend import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    block, width = 16, max(-(-n // 16) for n in lens)
    hk = model.config.num_key_value_heads
    caches = [(torch.randn(2, len(lens) * width, block, hk, head_dim, generator=g)).to(DEVICE, DTYPE)
              for _ in model.layers]
    for layer, cache in zip(model.layers, caches):
        layer.self_attn.kv_cache = cache
    tables = [[i * width + j for j in range(width)] for i in range(len(lens))]
    slots = [tables[i][(n - 1) // block] * block + (n - 1) % block for i, n in enumerate(lens)]
    ids = torch.randint(0, model.config.vocab_size, (len(lens),), generator=g)
    starts = list(range(len(lens) + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=torch.tensor(tables, dtype=torch.int32,
                                                                                   device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE), num_decodes=len(lens),
        seq_lens_cpu=lens, query_start_loc_cpu=starts, max_decode_seq_len=max(lens))
    backend.prepare(meta)
    positions = torch.tensor([n - 1 for n in lens], device=DEVICE)
    with torch.inference_mode():
        x, res = model.run_layers(positions, model.embed_tokens(ids.to(DEVICE)), None, meta, 0, len(model.layers))
        return model.final_norm(x, res).float().cpu(), [c.float().cpu() for c in caches]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: elementwise within rounding. bf16: the two paths round at different points (the
    folded weights, the fused epilogues), so single elements near zero differ by more than any
    relative bound; the whole tensor's error is held to a few bf16 epsilons instead."""
    if DTYPE == torch.bfloat16:
        err = float((got - want).norm() / want.norm())
        assert err < 2e-2, err
    else:
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms in the RoPE kernel after QKV
@pytest.mark.parametrize("lens", [[7], [3, 20, 16], [1, 5, 9, 17, 33, 2, 16, 30]], ids=["1", "3", "8"])
def test_fused_decode_layer_matches_the_unfused_one(model_dirs, monkeypatch, arch, lens):
    """Switch off vs on (norms folded into the weights, seven launches a layer): the same final
    hidden states and KV writes within float32 rounding. Small tiles so that every GEMV of
    the tiny model runs split over K (2 to 4 programs a tile)."""
    from expresslane.layers import fused_gemv as fg

    monkeypatch.setattr(fg, "fused_config", lambda n, silu: dict(block_n=32, block_k=32, stages=1, split=None))
    plain, backend, head_dim = _tiny_model(model_dirs[arch], seed=1)
    fused, fused_backend, _ = _tiny_model(model_dirs[arch], seed=1)
    fused.enable_fused_decode()
    assert all(layer.fused_rows == 16 for layer in fused.layers)
    assert all(bool((layer.input_layernorm.weight == 1).all()) for layer in fused.layers)
    from triton.runtime.jit import KernelInterface

    launches = []
    real_getitem = KernelInterface.__getitem__
    monkeypatch.setattr(KernelInterface, "__getitem__",
                        lambda self, grid: (launches.append(self.fn.__name__), real_getitem(self, grid))[1])
    want, want_caches = _decode_step(plain, backend, head_dim, lens, seed=2)
    assert "fused_gemv_kernel" not in launches  # switch off: today's path
    launches.clear()
    got, got_caches = _decode_step(fused, fused_backend, head_dim, lens, seed=2)
    # seven launches a layer (six where the attention runs unsplit), the final norm after them
    reduce = ["reduce_splits_kernel"] if fused_backend.num_splits(len(lens)) > 1 else []
    per_layer = ["fused_gemv_kernel", "rope_store_kernel", "paged_attention_kernel", *reduce] + ["fused_gemv_kernel"] * 3
    assert launches == per_layer * len(fused.layers) + ["_rmsnorm_kernel"], launches
    for a, b in zip([got, *got_caches], [want, *want_caches]):
        _assert_close(a, b)
    _counters_clear()


def test_refuses_a_mixture_of_experts(model_dirs):
    """The switch applies to dense, unquantized layers only: a mixture of experts is refused
    with the reason, its weights untouched."""
    from expresslane.attention.registry import get_backend
    from expresslane.models.model_dir import load_hf_config
    from expresslane.models.registry import model_class

    cfg = load_hf_config(model_dirs["mixtral"])
    backend = get_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads, 16, torch.device(DEVICE))
    model = model_class(cfg)(cfg, backend)
    assert "mixture-of-experts" in model.fused_decode_refusal()
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model.enable_fused_decode()
    assert all(layer.fused_rows == 0 for layer in model.layers)


@pytest.mark.parametrize("engine", [dict(attention_backend="torch"), dict(attention_backend="triton",
                                                                            quantization="fp8")],
                         ids=["torch-backend", "fp8-weights"])
def test_the_engine_keeps_todays_path_where_the_switch_does_not_apply(llama_dir, caplog, engine):
    """fused_decode_layer on the torch backend, or with quantized weights: logged, and nothing
    folded (the norm weights stay the checkpoint's)."""
    from expresslane import LLM

    with caplog.at_level("WARNING", logger="expresslane.runner.model_runner"):
        llm = LLM(str(llama_dir), max_model_len=64, num_kv_blocks=8, fused_decode_layer=True, **engine)
    [fused_rows] = llm.apply_model(lambda model: [layer.fused_rows for layer in model.layers])
    assert "fused_decode_layer is off" in caplog.text
    assert fused_rows and not any(fused_rows)
