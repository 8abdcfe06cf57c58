"""A smaller model proposing on the device, in the target's block ids (its own cache):
docs/architecture.md, "Speculative decoding"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from expresslane.attention.registry import get_backend
from expresslane.device import kv_zeros, to_device
from expresslane.distributed.group import TPGroup
from expresslane.contract import ScheduledSeq
from expresslane.models.loader import iter_weights
from expresslane.models.model_dir import load_hf_config
from expresslane.models.registry import model_class
from expresslane.runner.cuda_graphs import DecodeGraphs, DraftChainGraphs, MixedGraphs, Patch
from expresslane.runner.proposer import Proposer
from expresslane.runner.request_rows import StepInputs
from expresslane.runner.sampler import filter_logits
from expresslane.sampling_params import SamplingParams


class DraftModelProposer(Proposer):
    def __init__(self, model_dir: str | Path, vocab_size: int, device: torch.device, dtype: torch.dtype,
                 backend: str, num_speculative_tokens: int):
        hf = load_hf_config(model_dir)
        if hf.vocab_size != vocab_size:
            raise ValueError(f"the draft model {str(model_dir)!r} has a vocabulary of {hf.vocab_size} tokens, the "
                             f"model {vocab_size}: a draft must share the model's tokenizer")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        self.backend = get_backend(backend, heads, kv_heads, head_dim, device, dtype)
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
        self.num_speculative_tokens = num_speculative_tokens
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.chain_graphs: DraftChainGraphs | None = None

    @property
    def proposes_on_host(self) -> bool:
        return False

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [0] * k  # placeholders, computed in the verify step

    def catch_up(self, token_ids: list[int], num_computed: int, start: int) -> list[int]:
        return token_ids[num_computed:start]

    def computed_after(self, num_computed: int, accepted: int, k: int) -> int:
        return num_computed + min(accepted, k - 1)  # it was fed proposals 1..k-1

    def cost_ratio(self, target_params: int) -> float:
        return self.num_params / target_params  # by parameter count

    def build_graphs(self, max_num_seqs: int, mixed_tokens: int, max_blocks: int, pool, block_size: int) -> None:
        """Decode and mixed-step graphs and, for k > 1, the greedy chain."""
        logits_out = torch.empty(max_num_seqs, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        self.decode_graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, max_blocks, self.device, logits_out)
        self.mixed_graphs = MixedGraphs(self.model, self.backend, mixed_tokens, max_num_seqs, max_blocks, self.device,
                                        logits_out)
        families = [self.decode_graphs, self.mixed_graphs]
        if self.num_speculative_tokens > 1:
            self.chain_graphs = DraftChainGraphs(self.model, self.backend, max_num_seqs, max_blocks, self.device,
                                                 logits_out, self.num_speculative_tokens - 1, block_size)
            families.append(self.chain_graphs)
        if pool is not None:
            for graphs in families:
                graphs.capture(pool)

    def _forward(self, runner, step: StepInputs, patch: Patch | None) -> torch.Tensor:
        return runner.forward_logits(self.model, self.backend, self.decode_graphs, self.mixed_graphs, step, patch)

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        attn = self.model.layers[0].self_attn
        return 2 * block_size * attn.num_kv_heads * attn.head_dim * kv_dtype.itemsize * len(self.model.layers)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        attn = self.model.layers[0].self_attn
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        for layer in self.model.layers:
            layer.self_attn.kv_cache = kv_zeros(shape, kv_dtype, self.device)

    def step_proposals(self, runner, inputs: StepInputs, spec: np.ndarray, ends: np.ndarray, k: np.ndarray,
                       params: list[SamplingParams], generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor | None, Patch]:
        tokens, probs = self._propose(runner, inputs, spec, params, generator)
        fill = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, k)])  # the placeholders
        cols = np.concatenate([np.arange(n) for n in k])
        owner = np.repeat(np.arange(len(spec)), k)
        return tokens, probs, Patch(fill, owner * tokens.shape[1] + cols, tokens.reshape(-1))

    def _propose(self, runner, inputs: StepInputs, spec: np.ndarray, params: list[SamplingParams],
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [S, K] and, if one samples, their q [S, K, V]."""
        counts = inputs.num_spec[spec]
        width = int(counts.max())
        # catch-up and last known token: first proposals
        seqs = [inputs.seqs[i] for i in spec]
        first = [ScheduledSeq(s.request_id, [*s.draft_token_ids, s.token_ids[0]], s.start_pos - len(s.draft_token_ids),
                              [], True) for s in seqs]
        order = sorted(range(len(first)), key=lambda i: len(first[i].token_ids) != 1)  # decodes first
        step = runner.rows.gather([first[i] for i in order])
        where = {orig: new for new, orig in enumerate(order)}
        logits = self._forward(runner, step, None)[to_device([where[i] for i in range(len(seqs))], torch.int64,
                                                             self.device)]
        tokens = torch.zeros(len(spec), width, dtype=torch.int64, device=self.device)
        probs = None if all(p.greedy for p in params) else \
            torch.zeros(len(spec), width, logits.shape[-1], device=self.device)
        chain = self.chain_graphs
        for j in range(width):
            if j == 1 and probs is None and chain is not None and chain.fits(len(seqs), len(seqs)):
                # greedy: the rest in one replay
                step = runner.rows.gather([ScheduledSeq(s.request_id, [0], s.start_pos + 1, [], True) for s in seqs])
                patch = Patch(np.arange(len(seqs)), np.arange(len(seqs)), tokens[:, 0])
                tokens[:, 1:] = chain.run_chain(step, patch, counts)[:, :width - 1]
                break
            if j:  # feed proposal j to the seqs proposing more
                live = np.flatnonzero(counts > j)
                step = runner.rows.gather([ScheduledSeq(seqs[i].request_id, [0], seqs[i].start_pos + j, [], True)
                                            for i in live])
                patch = Patch(np.arange(len(live)), live, tokens[:, j - 1])
                rows = np.full(len(spec), 0, dtype=np.int64)  # (done: any row, unused)
                rows[live] = np.arange(len(live))
                logits = self._forward(runner, step, patch)[to_device(rows, torch.int64, self.device)]
            tokens[:, j], q = _choose(logits, params, generator)
            if probs is not None:
                probs[:, j] = q
        return tokens, probs


def _choose(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy rows: the argmax; the others: a draw from q."""
    out = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return out, None
    dev = logits.device
    temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
    q = filter_logits(logits / temps[:, None], params).softmax(dim=-1)
    noise = torch.empty_like(q).exponential_(generator=generator)
    greedy = to_device([p.greedy for p in params], torch.bool, dev)
    return torch.where(greedy, out, (q / noise).argmax(dim=-1)), q
