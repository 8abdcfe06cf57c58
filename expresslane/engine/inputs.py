"""Prompts -> token ids, checked against the model (torch-free: the offline engine and the
server's API process both use it)."""

from __future__ import annotations

from expresslane.engine.request import check_prompt_length
from expresslane.sampling_params import SamplingParams

Prompt = str | dict


class InputProcessor:
    """Prompt -> token ids, checked against the model (shared by the offline engine and the server)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos = eos

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt).__name__}")

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt_length(len(prompt_token_ids), self.max_model_len)
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
