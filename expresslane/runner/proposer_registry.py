"""Speculative decoding's Proposer: prompt lookup, a draft model, or none."""

from __future__ import annotations

import torch

from expresslane.config import SpeculativeConfig
from expresslane.runner.draft_model import DraftModelProposer
from expresslane.runner.ngram import NgramProposer
from expresslane.runner.proposer import Proposer


def make_proposer(config: SpeculativeConfig, vocab_size: int, device: torch.device, dtype: torch.dtype,
                  backend: str) -> Proposer | None:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        return DraftModelProposer(config.speculative_model, vocab_size, device, dtype, backend,
                                  config.num_speculative_tokens)
    return None
