"""Prompts -> token ids, checked against the model."""

from __future__ import annotations

from expresslane.scheduler.request import check_prompt_length
from expresslane.sampling_params import SamplingParamError, SamplingParams

Prompt = str | dict


class InputError(ValueError):
    """``param``: the field at fault, ``code``: OpenAI's code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code

    def field(self, where: str) -> str:
        """The field to name: `where` the prompt came from, if the prompt is at fault."""
        return where if self.param in ("prompt", "input") else self.param


class InputProcessor:

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos = eos
        # the Rust encoder: no transformers per-call wrapping
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.encode = (lambda text: backend.encode(text).ids) if backend is not None else tokenizer.encode

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            # checked in C (many long prompts)
            if ids and (not {int}.issuperset(map(type, ids)) or min(ids) < 0 or max(ids) >= self.vocab_size):
                raise InputError(f"prompt_token_ids must be integers in [0, {self.vocab_size})", "prompt")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt).__name__}")

    def truncate(self, text: str | None, ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """The last `keep` tokens (-1: the context's worth; None: all); a cut prompt loses its text."""
        if keep is None:
            return text, ids
        limit = self.max_model_len if keep == -1 else keep
        if limit > self.max_model_len:
            raise InputError(f"truncate_prompt_tokens ({keep}) is more than the model's context ({self.max_model_len} "
                             "tokens)", "truncate_prompt_tokens")
        return (text, ids) if len(ids) <= limit else (None, ids[-limit:])

    def check_pooling(self, prompt_token_ids: list[int]) -> None:
        """An embeddings input: not empty, at most the context (nothing is generated after it)."""
        try:
            check_prompt_length(len(prompt_token_ids), self.max_model_len, pooling=True)
        except ValueError as e:
            raise InputError(str(e), "input", "context_length_exceeded" if prompt_token_ids else "invalid_value") \
                from None

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            check_prompt_length(len(prompt_token_ids), self.max_model_len)
        except ValueError as e:  # empty, or longer than the context
            raise InputError(str(e), "prompt", "context_length_exceeded" if prompt_token_ids else "invalid_value") \
                from None
        if len(params.stop_token_ids) > self.vocab_size:
            raise InputError(f"{len(params.stop_token_ids)} stop token ids is more than the vocabulary has tokens "
                             f"({self.vocab_size})", "stop_token_ids")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InputError(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        try:
            params.update_from_tokenizer(self.tokenizer)
        except SamplingParamError as e:
            raise InputError(str(e), e.param) from None
        if any(t >= self.vocab_size for word in params.bad_words_token_ids or () for t in word):
            raise InputError(f"bad_words: a word's tokens are outside the model's vocabulary ({self.vocab_size})",
                             "bad_words")
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            if len(ids) > self.vocab_size or any(not 0 <= t < self.vocab_size for t in ids):
                raise InputError(f"{name}: token ids must be in [0, {self.vocab_size}), at most {self.vocab_size} "
                                 "of them", name)
