"""Which prefill seqs the library runs (prefill_attention "cudnn" and "auto"), and what stays on
the Triton kernel's work list; the engine path itself is in test_equivalence.py."""

import pytest
import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.registry import get_backend
from expresslane.attention.triton_backend import TritonAttentionBackend

QSL = [0, 1, 2, 600, 610, 1300]  # two decodes, then prefill seqs of 598, 10 and 690 tokens


LENS = [50, 60, 2000, 700, 690]  # the 598-token seq has 1,402 keys cached; the 690-token one none


def _meta(qsl=QSL, lens=LENS) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
                             block_tables=torch.zeros(len(lens), 600, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32), num_decodes=2,
                             seq_lens_cpu=lens, query_start_loc_cpu=qsl, max_decode_seq_len=60)


def test_long_prefill_seqs_go_to_the_library_and_leave_the_work_list():
    backend = TritonAttentionBackend(8, 2, 64, torch.device("cpu"), prefill_library="cudnn")
    assert backend.library_seqs(QSL, LENS, 2) == (2, 4) and backend.eager_step(QSL, LENS, 2)
    meta = _meta()
    backend.prepare(meta)
    assert meta.library_seqs == (2, 4)
    assert set(meta.prefill_work[:, 0].tolist()) == {3}  # only the 10-token seq stays on the kernel
    assert not backend.eager_step(QSL[:3] + [12], LENS[:3], 2)  # a short prefill: graphs may take the step


def test_auto_takes_long_chunks_over_long_contexts():
    """auto: a seq of AUTO_MIN_TOKENS query tokens or more over AUTO_MIN_CONTEXT keys or more goes
    to the library, whether a whole prompt or a chunk after cached keys; a shorter chunk, or a
    long one over a shorter context, stays on the kernel (and in the graphs)."""
    backend = TritonAttentionBackend(8, 2, 64, torch.device("cpu"), prefill_library="auto")
    n, ctx = backend.AUTO_MIN_TOKENS, backend.AUTO_MIN_CONTEXT
    # a whole prompt, a chunk after cached keys, a shorter chunk after them, a chunk over too few keys
    q_lens = [ctx, n, n - 1, n]
    lens = [50, 60, ctx, ctx + 5000, 9000, ctx - 1]
    qsl = [0, 1, 2]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    assert backend.library_seqs(qsl, lens, 2) == (2, 3) and backend.eager_step(qsl, lens, 2)
    meta = _meta(qsl, lens)
    backend.prepare(meta)
    assert meta.library_seqs == (2, 3) and set(meta.prefill_work[:, 0].tolist()) == {4, 5}
    assert not backend.eager_step(QSL, LENS, 2)  # the fixture's seqs: all shorter
    assert not backend.eager_step(qsl[:3] + [2 + n - 1], lens[:2] + [9000], 2)  # one token short


def test_without_the_library_every_seq_is_on_the_work_list():
    for backend in (TritonAttentionBackend(8, 2, 64, torch.device("cpu")),
                    TritonAttentionBackend(8, 2, 64, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn,
                                           prefill_library="cudnn")):  # an FP8 cache: the library cannot read it
        meta = _meta()
        backend.prepare(meta)
        assert meta.library_seqs == () and not backend.eager_step(QSL, LENS, 2)
        assert set(meta.prefill_work[:, 0].tolist()) == {2, 3, 4}


def test_the_library_needs_the_triton_backend():
    with pytest.raises(ValueError, match="needs the triton attention backend"):
        get_backend("torch", 8, 2, 64, torch.device("cpu"), prefill_library="cudnn")
    get_backend("torch", 8, 2, 64, torch.device("cpu"), prefill_library="auto")  # the default: nothing to route
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        TritonAttentionBackend(8, 2, 64, torch.device("cpu"), prefill_library="flash")


@pytest.mark.parametrize("n, cached", [(40, 0), (30, 100), (17, 400), (64, 128), (3, 5)])
def test_library_calls_have_bucketed_shapes_and_exact_output(monkeypatch, n, cached):
    """cuDNN builds a plan per new shape (40-550 ms on the H200): every call's query rows are a
    multiple of Q_BUCKET and the unmasked call's keys a multiple of KEY_BUCKET, whatever the chunk
    and its cached length; the zero rows and keys that pad them change no real row's output
    (against masked float32 attention)."""
    from expresslane.attention import library_prefill as lp

    monkeypatch.setattr(lp, "Q_BUCKET", 16)
    monkeypatch.setattr(lp, "KEY_BUCKET", 64)
    calls = []
    real = lp.attend_lse
    monkeypatch.setattr(lp, "attend_lse", lambda q, k, v, causal, scale: (
        calls.append((q.shape[2], k.shape[2], causal)), real(q, k, v, causal, scale))[1])
    g = torch.Generator().manual_seed(n + cached)
    heads, dim, ctx = 4, 32, n + cached
    q = torch.randn(n, heads, dim, generator=g)
    k, v = torch.randn(ctx, heads, dim, generator=g), torch.randn(ctx, heads, dim, generator=g)
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=cached)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    # cuDNN on a GPU (bf16), torch's CPU flash op here (float32)
    dev, dtype, tol = ("cuda", torch.bfloat16, 2e-2) if torch.cuda.is_available() else ("cpu", torch.float32, 1e-4)
    q, k, v = (x.to(dev, dtype) for x in (q, k, v))
    out = torch.full_like(q, float("nan"))
    lp.chunk_attention(q, k, v, dim ** -0.5, out)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol)
    assert [c for _, _, c in calls] == ([True, False] if cached >= 64 else [True])
    for q_rows, keys, causal in calls:
        assert q_rows % 16 == 0 and (keys == q_rows if causal else keys % 64 == 0), calls


def test_warm_up_builds_the_shapes_and_strides_of_a_long_prompts_chunks(monkeypatch):
    """The start-up warm-up is only worth its time if cuDNN's plan cache (keyed by shapes and
    strides) then hits: every call of a lone prompt's full-budget chunks, whatever its length,
    has the shapes and strides of a warmed call."""
    from expresslane.attention import library_prefill as lp

    monkeypatch.setattr(lp, "Q_BUCKET", 16)
    monkeypatch.setattr(lp, "KEY_BUCKET", 64)
    seen = set()

    def record(q, k, v, causal, scale):
        seen.add((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), causal))
        return q.new_zeros(q.shape), q.new_zeros(*q.shape[:3], 1, dtype=torch.float32)
    monkeypatch.setattr(lp, "attend_lse", record)
    heads, kv_heads, dim, budget, max_len = 8, 2, 32, 64, 320
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the merge kernel runs
    assert lp.warm_plans(heads, kv_heads, dim, torch.float32, dev, max_len, budget, 0.1) == 5
    warmed, seen = seen, set()
    for prompt in (130, 200, 256, 319):
        for start in range(budget, prompt - budget + 1, budget):  # its full-budget chunks after the first
            k = torch.randn(start + budget, kv_heads, dim, device=dev)  # as the gather leaves them: contiguous rows
            lp.chunk_attention(torch.randn(budget, heads, dim, device=dev), k, k.clone(), 0.1,
                               torch.empty(budget, heads, dim, device=dev))
    assert seen and seen <= warmed, seen - warmed
