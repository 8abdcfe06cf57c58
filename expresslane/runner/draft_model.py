"""The draft model of speculative decoding (``speculative_method="draft_model"``).

It shares the target's block tables: its own KV cache has as many blocks, and the
scheduler's block ids index both. It runs only in steps that speculate (a step that does
not costs nothing more than without it): first one forward over the speculating seqs, each
with the tokens its cache lacks (`ScheduledSeq.draft_token_ids`, the scheduler keeps count:
`Request.num_draft_computed`) and its last known token, which gives every proposal's first
token; then one single-token forward per further proposal, feeding the previous proposal in
on the device. Writes land in the request's own blocks: positions before its last known
token (computed by the target, so allocated) and the slots allocated for its k + 1 tokens.
A block shared through the prefix cache gets the same draft KV again (same tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from expresslane.attention.backend import get_backend
from expresslane.device import to_device
from expresslane.distributed.group import TPGroup
from expresslane.engine.contract import ScheduledSeq
from expresslane.models.loader import iter_weights
from expresslane.models.model_dir import load_hf_config
from expresslane.models.registry import model_class
from expresslane.runner.cuda_graphs import Patch
from expresslane.runner.input_batch import StepInputs
from expresslane.runner.sampler import filter_logits
from expresslane.sampling_params import SamplingParams


class DraftModel:
    def __init__(self, model_dir: str | Path, vocab_size: int, device: torch.device, dtype: torch.dtype,
                 backend: str):
        hf = load_hf_config(model_dir)
        if hf.vocab_size != vocab_size:
            raise ValueError(f"the draft model {str(model_dir)!r} has a vocabulary of {hf.vocab_size} tokens, the "
                             f"model {vocab_size}: a draft must share the model's tokenizer")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        self.backend = get_backend(backend, heads, kv_heads, head_dim, device)
        with torch.device(device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = model_class(hf)(hf, self.backend, None, TPGroup.single())
            finally:
                torch.set_default_dtype(prev)
        self.model.load_weights(iter_weights(Path(model_dir), device))
        self.model.eval()
        self.device, self.dtype = device, dtype
        self.num_params = sum(p.numel() for p in self.model.parameters())

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        attn = self.model.layers[0].self_attn
        return 2 * block_size * attn.num_kv_heads * attn.head_dim * kv_dtype.itemsize * len(self.model.layers)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        attn = self.model.layers[0].self_attn
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        for layer in self.model.layers:
            layer.self_attn.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)

    def propose(self, runner, inputs: StepInputs, spec: np.ndarray, params: list[SamplingParams],
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Proposals of the speculating seqs (`spec`: their indices in the step): tokens [S, K]
        and, when one samples, the draft's distributions q [S, K, V] they were drawn from."""
        counts = inputs.num_spec[spec]
        width = int(counts.max())
        # pass 0: each speculating seq's catch-up and last known token (its blocks are in the table already)
        seqs = [inputs.seqs[i] for i in spec]
        first = [ScheduledSeq(s.request_id, [*s.draft_token_ids, s.token_ids[0]], s.start_pos - len(s.draft_token_ids),
                              [], True) for s in seqs]
        order = sorted(range(len(first)), key=lambda i: len(first[i].token_ids) != 1)  # decodes first
        step = runner.batch._gather([first[i] for i in order])
        input_ids, positions, meta = runner._prepare(step, None, self.backend)
        hidden = self.model(input_ids, positions, meta)
        where = {orig: new for new, orig in enumerate(order)}
        last = step.query_start_loc[1:][[where[i] for i in range(len(seqs))]].astype(np.int64) - 1
        logits = self.model.compute_logits(hidden[to_device(last, torch.int64, self.device)])
        tokens = torch.zeros(len(spec), width, dtype=torch.int64, device=self.device)
        probs = None if all(p.greedy for p in params) else \
            torch.zeros(len(spec), width, logits.shape[-1], device=self.device)
        for j in range(width):
            if j:  # feed proposal j (1-based) at its position, for the seqs that propose more than j
                live = np.flatnonzero(counts > j)
                step = runner.batch._gather([ScheduledSeq(seqs[i].request_id, [0], seqs[i].start_pos + j, [], True)
                                             for i in live])
                patch = Patch(np.arange(len(live)), live, tokens[:, j - 1])
                input_ids, positions, meta = runner._prepare(step, patch, self.backend)
                hidden = self.model(input_ids, positions, meta)
                rows = np.full(len(spec), 0, dtype=np.int64)
                rows[live] = np.arange(len(live))
                logits = self.model.compute_logits(hidden[to_device(rows, torch.int64, self.device)])
            tokens[:, j], q = _choose(logits, params, generator)
            if probs is not None:
                probs[:, j] = q
        return tokens, probs


def _choose(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy rows: the argmax; the others: a draw from q (temperature and filters applied)."""
    out = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return out, None
    dev = logits.device
    temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
    q = filter_logits(logits / temps[:, None], params).softmax(dim=-1)
    noise = torch.empty_like(q).exponential_(generator=generator)
    greedy = to_device([p.greedy for p in params], torch.bool, dev)
    return torch.where(greedy, out, (q / noise).argmax(dim=-1)), q
