"""Which prefill seqs the library runs (prefill_attention "cudnn" and "auto"), and what stays on
the Triton kernel's work list; the engine path itself is in test_equivalence.py."""

import pytest
import torch

from expresslane.attention.backend import AttentionMetadata, get_backend
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


def test_auto_takes_only_long_prompts_with_nothing_cached():
    """auto: a whole prompt of FRESH_MIN_TOKENS or more goes to the library; a chunk after cached
    keys, however long, and a shorter whole prompt stay on the kernel (and in the graphs)."""
    backend = TritonAttentionBackend(8, 2, 64, torch.device("cpu"), prefill_library="auto")
    n = backend.FRESH_MIN_TOKENS
    qsl = [0, 1, 2, 2 + n, 2 + 2 * n, 2 + 2 * n + n - 16]  # whole prompt, chunk after cache, short prompt
    lens = [50, 60, n, 2 * n, n - 16]
    assert backend.library_seqs(qsl, lens, 2) == (2,) and backend.eager_step(qsl, lens, 2)
    meta = _meta(qsl, lens)
    backend.prepare(meta)
    assert meta.library_seqs == (2,) and set(meta.prefill_work[:, 0].tolist()) == {3, 4}
    assert not backend.eager_step(QSL, LENS, 2)  # the fixture's seqs: all shorter, or after cache
    assert not backend.eager_step(qsl[:4], lens[:2] + [n + 1], 2)  # n tokens after one cached


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
