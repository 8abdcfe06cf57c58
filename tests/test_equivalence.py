"""Greedy tokens equal transformers' (float32, CPU) for every architecture, whatever the
batch composition: chunked prefill, prefix-cache hits and preemptions included."""

import random

import pytest
from models import ARCHS, hf_greedy

from expresslane import LLM, SamplingParams

MAX_TOKENS = 10
LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 128, 200, 255, 256, 257, 300]


def make_prompts(vocab_limit: int = 500) -> list[list[int]]:
    rng = random.Random(1234)
    prompts = [[rng.randrange(vocab_limit) for _ in range(n)] for n in LENGTHS]
    shared = [rng.randrange(vocab_limit) for _ in range(120)]
    prompts += [shared + [rng.randrange(vocab_limit) for _ in range(n)] for n in (1, 7, 40, 130)]
    prompts.append(list(prompts[-1]))  # an identical prompt: the hit must stop before its last token
    return prompts


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# Each case under the default policy (deadline) unless it names fcfs. Under deadline the steps
# follow a cost model timed at start-up, so which prompts share a step (and so which prefixes
# are cached before a prompt starts) depends on the machine; fcfs cases also check the hits.
CASES = {
    "chunk16-nocache": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    # fcfs: one prompt's 16-token chunks fill each step, so the prompts sharing a prefix run after the first
    "chunk16-cache": dict(max_num_batched_tokens=16, enable_prefix_caching=True, scheduling_policy="fcfs"),
    # fcfs: a whole prompt in one step, so later prompts of the same step hit its whole prefix
    "big-budget-cache": dict(max_num_batched_tokens=4096, enable_prefix_caching=True, scheduling_policy="fcfs"),
    # the default policy with too little KV cache for the prompts at once: preemptions where its steps run
    # many prompts together (5 of 6 architectures on the 2-core CPU); tokens exact whatever the schedule
    "small-cache": dict(max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True),
    # fcfs, the same cache: the 64-token steps admit prompts in order until blocks run out (preemptions forced)
    "preempt": dict(max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True,
                    scheduling_policy="fcfs"),
}


@pytest.fixture(scope="module")
def references(model_dirs):
    return {arch: [hf_greedy(d, p, MAX_TOKENS) for p in PROMPTS] for arch, d in model_dirs.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(model_dirs, references, arch, case):
    llm = LLM(str(model_dirs[arch]), **CASES[case])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (g, r) in enumerate(zip(got, references[arch])) if g != r]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    core = llm.engine.core
    if not CASES[case]["enable_prefix_caching"]:
        assert all(o.num_cached_tokens == 0 for o in outs)
    elif CASES[case].get("scheduling_policy") == "fcfs":
        hits = [o.num_cached_tokens for o in outs[len(LENGTHS):]]
        # length classes (RoPE by prompt length) split the shared prefix's prompts into smaller groups, and
        # longrope restarts the prompts that grow past 128 tokens: fewer, smaller hits, but some
        need = 1 if arch in ("phi3", "llama_dynamic") else 112
        assert max(hits) >= need, f"shared prefixes should hit the cache, got {hits}"
    assert outs[-1].num_cached_tokens < len(PROMPTS[-1])
    if case == "preempt":
        assert core.scheduler.num_preemptions > 0, "the small KV cache should have forced preemptions"
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks


def test_triton_backend_matches_transformers(model_dirs, references):
    """The GPU kernels' engine path (through Triton's interpreter on CPU): chunks, hits, preemption."""
    pytest.importorskip("triton")
    arch = "qwen2"  # grouped heads (2 per KV head), tied embeddings, qkv bias
    picked = [0, 4, 9, 15, 17, 19]  # short, mid and long prompts; three sharing a prefix (hits), one twice
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=128, max_model_len=384,
              num_kv_blocks=24, scheduling_policy="fcfs")  # fcfs: admits until the blocks run out (preemptions)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert llm.engine.core.scheduler.num_preemptions > 0 and max(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("arch", ["phi3", "llama_dynamic"])
def test_length_dependent_rope_through_triton_matches_transformers(model_dirs, references, arch):
    """RoPE whose rows follow the prompt length (Phi-3's LongRoPE with partial rotary; dynamic NTK)
    through the Triton kernels and the CUDA graphs' static inputs (run eagerly on CPU): prompts
    under, at and over the threshold of 128 tokens, decodes crossing it, prefixes shared within a
    length class (hits) and across classes (no hits), and preemptions."""
    pytest.importorskip("triton")
    picked = [9, 15, 16, 17, 19]  # 128; 121, 127 | 160, 250 on one prefix
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=128, max_num_seqs=6,
              max_model_len=384, num_kv_blocks=24, scheduling_policy="fcfs")
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert llm.engine.core.scheduler.num_preemptions > 0
    hits = {i: o.num_cached_tokens for i, o in zip(picked, outs)}
    assert max(hits.values()) > 0 and hits[17] == 0, hits  # 160 tokens: no earlier prompt of its class


@pytest.mark.parametrize("library", ["cudnn", "auto"])
def test_library_prefill_matches_transformers(model_dirs, references, monkeypatch, library):
    """Long prefill seqs through the library path (torch's CPU flash op stands in for cuDNN on
    CPU) in eager steps beside the Triton kernel's seqs and decodes, with graphs built. cudnn:
    chunks after cached tokens (split + merge) and whole prompts; auto: those of AUTO_MIN_TOKENS
    or more over AUTO_MIN_CONTEXT keys or more."""
    pytest.importorskip("triton")
    from expresslane.attention import triton_backend

    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "LIBRARY_MIN_TOKENS", 24)
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "AUTO_MIN_TOKENS", 24)
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "AUTO_MIN_CONTEXT", 150)
    calls = []  # (query tokens, keys) of each seq the library ran
    real = triton_backend.seq_attention
    monkeypatch.setattr(triton_backend, "seq_attention", lambda q, kv, meta, i, *a: (
        calls.append((meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i], meta.seq_lens_cpu[i])),
        real(q, kv, meta, i, *a))[1])
    arch = "qwen2"  # grouped heads (2 per KV head)
    picked = [0, 9, 14]  # 1, 128 and 300 tokens
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", prefill_attention=library, max_num_batched_tokens=96,
              max_model_len=384, num_kv_blocks=64, scheduling_policy="fcfs")
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    cached = [keys - tokens for tokens, keys in calls]
    if library == "cudnn":
        assert 0 in cached and any(c > 0 for c in cached), calls  # whole prompts and chunks after cached keys
    else:  # only long chunks over long contexts: here, chunks of the 300-token prompt after cached keys
        assert calls and all(tokens >= 24 and keys >= 150 for tokens, keys in calls) and min(cached) > 0, calls


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_graph_input_path_matches_transformers(model_dirs, references, monkeypatch, split):
    """The CUDA-graph families' static buffers and padding, run eagerly (no capture) on CPU:
    decode batches padded to a bucket, small mixed steps on a padded work list, each mixed
    bucket with a prefill tile of its own (8, 16, 32 query tokens per work item); `split`:
    prefill items also cut over their keys (slices of >= 16 keys, 64 SMs)."""
    pytest.importorskip("triton")
    from expresslane.attention import triton_backend
    from expresslane.attention.triton_tiles import PrefillTile

    arch = "qwen3"
    picked = [5, 16] if split else [0, 2, 3, 5, 8, 16, 17]  # (split: the kernel path, fewer prompts)
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=48, max_num_seqs=6,
              max_model_len=384, num_kv_blocks=64)
    runner = llm.engine.runner
    tiles = ((0, PrefillTile(rows=16, block_n=16)), (16, PrefillTile(rows=32, block_n=32)),
             (48, PrefillTile(rows=64, block_n=16)))  # head dim 32, group 2; buckets 8, 16, 32, 48
    runner.attn_backend.prefill_tiles = {32: tiles}
    splits = []
    if split:
        monkeypatch.setattr(triton_backend.TritonAttentionBackend, "SPLIT_MIN_KEYS", 16)
        runner.attn_backend.sms = 64
        real_plan = runner.attn_backend.plan_prefill
        runner.attn_backend.plan_prefill = lambda *a: (w := real_plan(*a), splits.append(int(w[:, 3].max())))[0]
    runner.build_graphs(llm.config.model.max_model_len, capture=False)
    used = {"decode": 0, "mixed": 0}
    for family in used:
        graphs = getattr(runner, f"{family}_graphs")
        real_run = graphs.run
        graphs.run = lambda *a, _f=family, _r=real_run: (used.__setitem__(_f, used[_f] + 1), _r(*a))[1]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert used["decode"] > 0 and used["mixed"] > 0, used
    assert max(splits, default=1) > 1 if split else not splits


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline"])
@pytest.mark.parametrize("batching", ["continuous", "static", "dynamic"])
def test_every_policy_and_batching_matches_transformers(model_dirs, references, policy, batching):
    """Whatever the order, step sizes, step-aside and preemptions a policy and batching mode
    choose, each request's greedy tokens are transformers'. Mixed priorities and lanes, a
    small budget and a small KV cache make the policies act (preempt, cap, share)."""
    arch = "llama"
    picked = [0, 2, 4, 6, 8, 9, 16, 17, 18]
    llm = LLM(str(model_dirs[arch]), scheduling_policy=policy, batching=batching, max_num_batched_tokens=32,
              long_prefill_token_threshold=8, max_model_len=384, num_kv_blocks=24, max_num_seqs=4,
              max_batch_size=3, batch_timeout_ms=1.0)
    priorities = [i % 3 for i in range(len(picked))]
    lanes = ["batch" if i % 2 else "interactive" for i in range(len(picked))]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, priority=priorities, lane=lanes,
                        use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    if batching == "continuous":
        assert core.scheduler.num_preemptions > 0, "the small KV cache should have forced preemptions"
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "deadline"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_two_lanes_match_transformers(model_dirs, references, arch, policy):
    """`pd_lanes on` (issue #45): prompt chunks and decodes in their own steps, each lane's
    previous-step tokens its own; chunks, prefix hits published on landing, preemptions and
    (gemma3) KV groups whose windows free blocks."""
    llm = LLM(str(model_dirs[arch]), pd_lanes="on", scheduling_policy=policy, max_num_batched_tokens=64,
              max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in enumerate(outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the small KV cache should have forced preemptions"
    assert any(o.num_cached_tokens for o in outs[len(LENGTHS):]), "shared prefixes should hit the cache"
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_moe_matches_transformers(model_dirs, references, arch):
    """The fused MoE kernels in the engine (Triton's interpreter on CPU), through the CUDA-graph
    input path (padded decode batches and mixed steps), chunks, hits and preemption."""
    pytest.importorskip("triton")
    picked = [0, 5, 16, 17, 19]
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=128, max_num_seqs=6,
              max_model_len=384, num_kv_blocks=24)
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert llm.engine.core.scheduler.num_preemptions > 0 and max(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("arch", ["qwen2"])  # qkv bias, tied embeddings (one model: the interpreter is slow)
def test_fused_decode_layer_matches_transformers(model_dirs, references, monkeypatch, arch):
    """fused_decode_layer (norms folded into the QKV and gate|up weights at load) in the engine:
    decode batches of up to 6 through the CUDA-graph input path run the six-launch layer;
    prefill chunks the plain path with the folded weights. Tokens as transformers'."""
    pytest.importorskip("triton")
    from expresslane.models.llama import DecoderLayer

    fused = []
    real = DecoderLayer._fused_decode
    monkeypatch.setattr(DecoderLayer, "_fused_decode", lambda self, *a: (fused.append(1), real(self, *a))[1])
    picked = [0, 4, 9, 16, 17]
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=48, max_num_seqs=6,
              max_model_len=384, num_kv_blocks=48, fused_decode_layer=True)
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != references[arch][i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert fused and llm.apply_model(lambda model: all(layer.fused_rows for layer in model.layers)) == [True]


@pytest.mark.parametrize("layers", [1, 2, 9, 28, 32, 48, 80])
def test_graph_pieces_cover_every_layer_once_growing(layers):
    """A mixed graph's pieces: consecutive layer ranges covering the model, the first the
    shortest (its launch is all the GPU waits for) and none shorter than the one before."""
    from expresslane.runner.cuda_graphs import piece_bounds

    bounds = piece_bounds(layers, 4)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == layers and sum(sizes) == layers
    assert sizes == sorted(sizes)
    if layers >= 16:
        assert sizes[0] <= layers // 10 and sizes[-1] >= layers // 3
