"""Sliding-window attention as a KV-cache policy: a query at position p sees keys p - W < j <= p
(transformers' sliding_window_overlay), in the torch backend and the Triton kernels, which read no
block before a window; the KV manager frees the blocks that leave a KV group's window while the
request runs. Greedy tokens equal transformers float32 for a tiny random Mistral whose window is
smaller than the prompts, and for models with some layers windowed (their own KV group)."""

import logging

import pytest
import torch
from models import build_model, exact_attention, hf_greedy, triton_through_graphs
from test_equivalence import CASES, GREEDY, MAX_TOKENS, PROMPTS
from test_triton_attention import DEVICE, make_step

from expresslane import LLM, SamplingParams
from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.contract import StepStats
from expresslane.layers.rotary import RotaryEmbedding
from expresslane.models.registry import MODELS
from expresslane.scheduler.kv_cache import KVCacheManager, hash_block
from expresslane.scheduler.request import Request

WINDOW = 48  # three blocks of 16 tokens, smaller than most test prompts
BLOCK = 16


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):
    return build_model("mistral", tmp_path_factory.mktemp("swa") / "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def swa_refs(swa_dir):
    return [hf_greedy(swa_dir, p, MAX_TOKENS) for p in PROMPTS]


# -- which layers slide -------------------------------------------------------------------------
def test_windows_per_layer_as_transformers_reads_the_config():
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    n = dict(num_hidden_layers=3)
    mistral, qwen2 = MODELS["MistralForCausalLM"], MODELS["Qwen2ForCausalLM"]
    assert mistral.attention_windows(MistralConfig(sliding_window=32, **n)) == [32, 32, 32]
    assert mistral.attention_windows(MistralConfig(sliding_window=None, **n)) == [None] * 3
    assert MODELS["MixtralForCausalLM"].attention_windows(MixtralConfig(sliding_window=32, **n)) == [32] * 3
    # Qwen2: the layers from max_window_layers on slide, and only with use_sliding_window
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=1, **n)
    assert qwen2.attention_windows(qwen) == [None, 32, 32]
    assert qwen2.attention_windows(Qwen2Config(use_sliding_window=False, sliding_window=32, **n)) == [None] * 3
    llama = LlamaConfig(**n)
    llama.sliding_window = 32  # transformers' Llama ignores it
    assert MODELS["LlamaForCausalLM"].attention_windows(llama) == [None] * 3
    bad = MistralConfig(**n)
    bad.sliding_window = -4
    with pytest.raises(ValueError, match="sliding_window"):
        mistral.attention_windows(bad)


# -- the kernels --------------------------------------------------------------------------------
def windowed_step(heads, kv_heads, dim, window, seqs, seed):
    """Rotated q and the written cache of a step; the exact output; then every block wholly
    before its seq's first window filled with NaN (as a freed block may hold anything): an
    implementation that reads one, even masked, returns NaN."""
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, BLOCK, torch.float32, seed)
    q = TorchAttentionBackend().store(pos, q, k, v, RotaryEmbedding(dim, 1024, 10000.0).to(q.device), kv, meta)
    exact = exact_attention(q, kv, meta, dim ** -0.5, window)
    for i, (cached, _) in enumerate(seqs):
        first = max(0, cached - window + 1) // BLOCK
        kv[:, meta.block_tables[i, :first].long()] = float("nan")
    return q, kv, meta, exact


WINDOW_CASES = [  # (heads, kv_heads, head_dim, window, seqs: (cached, new), decodes first)
    (4, 2, 16, 20, [(0, 1), (30, 1), (100, 1), (0, 50), (37, 20), (120, 33)]),  # window not a block multiple
    (8, 2, 32, 48, [(200, 1), (5, 1), (64, 1), (0, 90), (150, 64)]),
    (4, 1, 64, 16, [(300, 1), (40, 17), (0, 40)]),  # a window of one block, multi-query
]


def _variant(name: str, window: int) -> tuple[dict, dict]:
    """(backend arguments, attributes) of a tile variant: the tables' defaults; small tiles with
    decode and prefill splits planned over the whole context (slices before the window walk
    nothing); the same planned over the window (as for a model whose every layer has it)."""
    from expresslane.attention.triton_tiles import DecodeTile, PrefillTile

    if name == "default":
        return {}, {}
    small = {d: ((0, PrefillTile(rows=16, block_n=16)),) for d in (16, 32, 64)}
    split = {d: ((1, DecodeTile(max_splits=4, waves=64, block_n=16)),) for d in (16, 32, 64)}
    args = dict(prefill_tiles=small, decode_tiles=split, window=window if name == "window-planned" else None)
    return args, dict(SPLIT_MIN_KEYS=16, sms=64 if name == "small-split" else 1024)


@pytest.mark.parametrize("variant", ["default", "small-split", "window-planned"])
@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
def test_windowed_kernels_match_the_exact_attention(case, variant):
    """The torch backend and the Triton kernels (the interpreter on CPU) against float64
    attention, reading no block before a window (the NaN ones)."""
    triton_backend = pytest.importorskip("expresslane.attention.triton_backend")
    heads, kv_heads, dim, window, seqs = WINDOW_CASES[case]
    q, kv, meta, exact = windowed_step(heads, kv_heads, dim, window, seqs, seed=case)
    scale = dim ** -0.5
    ref = TorchAttentionBackend().attend(q, kv, meta, scale, window=window)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref, exact, rtol=1e-5, atol=1e-5)
    args, attributes = _variant(variant, window)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE, **args)
    for name, value in attributes.items():
        setattr(backend, name, value)
    backend.prepare(meta)
    if variant == "small-split" or (variant == "window-planned" and window >= 48):  # (else too few keys)
        assert meta.prefill_work[:, 3].max() > 1
    out = backend.attend(q, kv, meta, scale, window=window)
    assert torch.isfinite(out).all()
    err = (out - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_window_with_a_soft_cap():
    """Gemma 2's sliding layers: the window and the score cap together, Triton against torch."""
    triton_backend = pytest.importorskip("expresslane.attention.triton_backend")
    heads, kv_heads, dim, window, seqs = WINDOW_CASES[0]
    q, kv, meta, _ = windowed_step(heads, kv_heads, dim, window, seqs, seed=5)
    q = q * 4  # scores far past the cap
    ref = TorchAttentionBackend().attend(q, kv, meta, dim ** -0.5, softcap=2.0, window=window)
    args, attributes = _variant("small-split", window)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE, **args)
    for name, value in attributes.items():
        setattr(backend, name, value)
    backend.prepare(meta)
    out = backend.attend(q, kv, meta, dim ** -0.5, softcap=2.0, window=window)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_kernel_walks_only_the_window(monkeypatch):
    """Key tiles walked (through the interpreter): a decode at 400 keys and a 16-token chunk after
    300 walk the tiles from their first window on, not every tile of the context."""
    if DEVICE.type != "cpu":
        pytest.skip("counts the interpreter's calls")
    from expresslane.attention import triton_kernels
    from expresslane.attention.triton_backend import TritonAttentionBackend
    from expresslane.attention.triton_tiles import DecodeTile, PrefillTile

    tiles = []
    real = triton_kernels._attend_keys
    monkeypatch.setattr(triton_kernels, "_attend_keys", lambda *a: (tiles.append(1), real(*a))[1])
    heads, kv_heads, dim, window, n = 4, 2, 16, 32, 16
    seqs = [(399, 1), (300, 16)]
    q, kv, meta, exact = windowed_step(heads, kv_heads, dim, window, seqs, seed=3)
    backend = TritonAttentionBackend(heads, kv_heads, dim, DEVICE,
                                     prefill_tiles={16: ((0, PrefillTile(rows=16, block_n=n)),)},
                                     decode_tiles={16: ((1, DecodeTile(max_splits=1, block_n=n)),)})
    backend.prepare(meta)
    out = backend.attend(q, kv, meta, dim ** -0.5, window=window)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
    expected = 0
    bq = backend.block_q(meta.prefill_tile)  # 8 query tokens an item
    for first, end in [(399, 400)] + [(300 + off, min(316, 300 + off + bq)) for off in range(0, 16, bq)]:
        start = max(0, first - window + 1) // n * n
        expected += -(-(end - start) // n)
    assert len(tiles) == expected * kv_heads
    assert expected <= 2 + 2 * (-(-(window + bq) // n) + 1)  # against 25 + 40 tiles without the window


# -- the KV manager -----------------------------------------------------------------------------
def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    from expresslane.contract import EngineCoreRequest

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request.from_core_request(EngineCoreRequest(rid, prompt, sp, (0,), 0.0, 0, "interactive"), 4096)


def test_a_request_of_8x_the_window_holds_the_window_and_one_block():
    kv = KVCacheManager(64, BLOCK, windows=(WINDOW,))
    req = _request("a", list(range(1, 41)), 8 * WINDOW)
    held = []
    for start in range(0, 40, BLOCK):  # the prompt in chunks of one block
        n = min(BLOCK, 40 - start)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        held.append(kv.num_held_blocks("a"))
    while req.num_tokens < 8 * WINDOW:  # then decode, one token a step
        req.append_token(7)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        held.append(kv.num_held_blocks("a"))
    assert max(held) == WINDOW // BLOCK + 1
    table = kv.block_ids("a")
    assert len(table) == 8 * WINDOW // BLOCK and kv.window_saved_blocks == len(table) - held[-1]
    assert kv.window_freed_blocks == kv.window_saved_blocks and kv.pool.num_free == 64 - held[-1]
    kv.free(req)
    assert kv.pool.num_free == 64 and kv.window_saved_blocks == 0


def test_a_windowed_hit_needs_only_the_blocks_the_window_reaches():
    """The early blocks of a cached prefix gone (reallocated): a hit still covers every block
    whose window's blocks are cached, with the entries before it null; a gap in the window
    shortens the hit to before the gap."""
    kv = KVCacheManager(32, 4, windows=(6,))
    tokens = list(range(1, 42))
    a = _request("a", tokens, 1)
    assert kv.allocate_slots(a, 41)  # (a whole prompt in one step: nothing out of its first window yet)
    a.num_computed_tokens = 41
    kv.free(a)
    hashes, parent = [], None
    for i in range(10):
        parent = hash_block(parent, tokens[4 * i:4 * i + 4])
        hashes.append(parent)
    for i in (0, 1, 2):  # forget a's first blocks (as their reuse by another request does)
        block = kv.pool.lookup(hashes[i])
        del kv.pool._cached[hashes[i]]
        block.block_hash = None
    b = _request("b", tokens + [50, 51], 1)
    hit = kv.find_cached_prefix(b)
    # 10 full blocks; the hit of all 10 (40 tokens) needs blocks 35 // 4 = 8 and 9
    assert len(hit) == 10 and hit[:8] == [(None,)] * 8 and [blk.block_hash for blk, in hit[8:]] == hashes[8:]
    assert kv.allocate_slots(b, 2, hit)
    assert kv.num_held_blocks("b") == 3 and kv.block_ids("b")[:8] == [0] * 8
    kv.free(b)
    gap = kv.pool.lookup(hashes[8])
    del kv.pool._cached[hashes[8]]
    gap.block_hash = None
    hit = kv.find_cached_prefix(_request("c", tokens + [50, 51], 1))
    # before the gap: a hit of 8 blocks (32 tokens) needs blocks 27 // 4 = 6 and 7
    assert len(hit) == 8 and hit[:6] == [(None,)] * 6 and [blk.block_hash for blk, in hit[6:]] == hashes[6:8]


# -- the engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_greedy_matches_transformers(swa_dir, swa_refs, case):
    """Every prompt of the equivalence suite, most longer than the window, through its cases:
    chunked prefill, prefix-cache hits, preemption. Blocks are freed as requests move on."""
    llm = LLM(str(swa_dir), **CASES[case])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in enumerate(outs) if o.outputs[0].token_ids != swa_refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    assert llm.engine.runner.kv_groups == (WINDOW,) and core.kv.window_freed_blocks > 0
    if CASES[case].get("scheduling_policy") == "fcfs" and CASES[case]["enable_prefix_caching"]:
        assert max(o.num_cached_tokens for o in outs) >= 112
    if case == "preempt":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks
    assert core.kv.window_saved_blocks == 0


def test_engine_request_of_8x_the_window(swa_dir, caplog):
    """A 40-token prompt that runs to 8x the window, in one-block chunks: after every plan the KV
    manager's count of its blocks is at most the window and one block; tokens as transformers'."""
    prompt = PROMPTS[5][:40]
    with caplog.at_level(logging.INFO, logger="expresslane.engine.core"):
        llm = LLM(str(swa_dir), max_num_batched_tokens=BLOCK, enable_prefix_caching=False)
    assert f"sliding windows (KV groups ({WINDOW},))" in caplog.text
    core = llm.engine.core
    held = []
    real = core.scheduler.schedule
    core.scheduler.schedule = lambda: (plan := real(), held.append(core.kv.num_held_blocks()))[0]
    max_tokens = 8 * WINDOW - len(prompt)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(swa_dir, prompt, max_tokens)
    assert len(held) >= max_tokens and max(held) == WINDOW // BLOCK + 1
    assert core.kv.window_freed_blocks == 8 * WINDOW // BLOCK - (WINDOW // BLOCK + 1)


def test_prefix_hit_after_the_early_blocks_are_gone(swa_dir):
    """A 200-token prompt in a pool of 12 blocks reuses its own first block for its last: the
    same prompt plus 20 tokens then hits 192 tokens (the window's blocks are still cached)
    without block 0, and its tokens are transformers'."""
    llm = LLM(str(swa_dir), max_num_batched_tokens=BLOCK, num_kv_blocks=12, scheduling_policy="fcfs")
    first = PROMPTS[-2][:200]  # (250 tokens, the last 130 its own)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], one, use_tqdm=False)
    kv = llm.engine.core.kv
    assert kv.pool.lookup(hash_block(None, first[:BLOCK])) is None  # block 0's tokens: gone
    second = first + PROMPTS[8][:20]
    out = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 192
    assert out.outputs[0].token_ids == hf_greedy(swa_dir, second, MAX_TOKENS)


def test_triton_backend_windowed_matches_transformers(swa_dir, swa_refs):
    """The kernels in the engine (the interpreter on CPU) through the CUDA-graph input path, with
    chunks, prefix hits and preemption."""
    pytest.importorskip("triton")
    llm = triton_through_graphs(swa_dir, PROMPTS, swa_refs, num_kv_blocks=16)
    assert llm.engine.core.kv.window_freed_blocks > 0


def test_tensor_parallel_windowed_matches_transformers(swa_dir, swa_refs):
    """TP=2 over gloo: each rank applies the window to its heads; the plans (null entries
    included) reach the worker as they are. Chunks, prefix hits and preemption."""
    from test_tensor_parallel import CASE, PICKED

    llm = LLM(str(swa_dir), tensor_parallel_size=2, **{**CASE, "num_kv_blocks": 12})  # (the window needs few)
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in PICKED], GREEDY, use_tqdm=False)
        core = llm.engine.core
        assert llm.engine.runner.kv_groups == (WINDOW,) and core.kv.window_freed_blocks > 0
        assert core.scheduler.num_preemptions > 0 and core.kv.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    mismatched = [i for i, o in zip(PICKED, outs) if o.outputs[0].token_ids != swa_refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


def test_prompt_lookup_speculation_with_a_window(swa_dir, swa_refs):
    """ngram proposals on a windowed model: verify steps of k + 1 tokens read their windows, blocks
    are freed behind the verified position; tokens as transformers'. Repetitive prompts (the
    shared-prefix ones, twice over) give proposals."""
    picked = list(range(len(PROMPTS) - 5, len(PROMPTS)))
    llm = LLM(str(swa_dir), speculative_method="ngram", num_speculative_tokens=3,
              speculative_disable_by_batch_size=64, max_num_batched_tokens=64, scheduling_policy="fcfs")
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != swa_refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    assert core.kv.window_freed_blocks > 0 and core.spec.counters.num_draft_tokens > 0


@pytest.mark.parametrize("arch", ["qwen2", "ministral"])
def test_some_layers_windowed_free_in_their_kv_group(tmp_path, arch):
    """A window on one of two layers (Qwen2: the second, from max_window_layers; Ministral: the
    first, from layer_types): two KV groups of one layer each; the windowed layer's group frees
    the blocks that leave its window, the other keeps every block."""
    extra = dict(use_sliding_window=True, sliding_window=24, max_window_layers=1) if arch == "qwen2" else {}
    d = build_model(arch, tmp_path / arch, **extra)
    picked = [PROMPTS[i] for i in (4, 9, 12)]  # 16, 128 and 255 tokens
    llm = LLM(str(d), max_num_batched_tokens=32)
    windows = [None, 24] if arch == "qwen2" else [24, None]
    assert llm.apply_model(lambda model: model.windows) == [windows]
    assert llm.engine.runner.kv_groups == tuple(windows) and llm.engine.runner.layer_slab == [0, 0]
    outs = llm.generate([{"prompt_token_ids": p} for p in picked], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, MAX_TOKENS) for p in picked]
    assert llm.engine.core.kv.window_freed_blocks > 0


def test_library_prefill_has_no_window(swa_dir):
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="prefill_attention 'cudnn'"):
        LLM(str(swa_dir), attention_backend="triton", prefill_attention="cudnn")


def test_window_metrics():
    from expresslane.server.metrics import Metrics

    metrics = Metrics("m")
    metrics.engine_step(StepStats(1, 0, 0.5, window_freed_blocks=7, window_saved_blocks=3))
    metrics.engine_step(StepStats(1, 0, 0.5, window_freed_blocks=9, window_saved_blocks=2))
    text = metrics.render().decode()
    assert 'expresslane:sliding_window_freed_blocks_total{model_name="m"} 9.0' in text
    assert 'expresslane:sliding_window_saved_blocks{model_name="m"} 2.0' in text


def test_phi3_window_frees_blocks_across_its_longrope_switch(tmp_path):
    """Phi-3 windows every layer: a 100-token prompt decoding past LongRoPE's original length (128,
    where the request restarts on the long factors) frees the blocks behind its window of 32 and
    keeps max_model_len the model's; tokens as transformers'."""
    d = build_model("phi3", tmp_path / "phi3", sliding_window=32)
    llm = LLM(str(d), max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.engine.runner.kv_groups == (32,) and llm.config.model.max_model_len > 128
    prompt = [(5 * j) % 400 + 3 for j in range(100)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(d, prompt, 60)
    assert llm.engine.core.kv.window_freed_blocks > 0
