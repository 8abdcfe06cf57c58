"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


def valid_truncation(k) -> bool:
    """A `truncate_prompt_tokens`: None, -1 or an integer >= 1."""
    return k is None or (isinstance(k, int) and not isinstance(k, bool) and (k == -1 or k >= 1))


class SamplingParamError(ValueError):
    """A parameter out of range; ``param`` names it (the server answers 400 naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class StructuredOutputs:
    """Constrain the output to a grammar: exactly one of these (vLLM's ``StructuredOutputsParams``).
    ``json`` is a JSON schema as JSON text; ``json_object``: any JSON object; ``regex``; ``choice``:
    one of these strings; ``grammar``: an EBNF (GBNF) grammar whose start rule is ``root``."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # the grammar starts after these tokens are generated (a reasoning model's end of thinking); None: at once
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise SamplingParamError("structured_outputs", "structured_outputs must set exactly one of json, "
                                     f"json_object, regex, choice and grammar, got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingParamError("structured_outputs", "structured_outputs.choice must be a non-empty list of "
                                     "non-empty strings")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        return (self.json, self.json_object, self.regex, tuple(self.choice or ()), self.grammar)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's: the top-k at each prompt position and the prompt token itself (the first has none); None: off
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    repetition_penalty: float = 1.0  # divides (positive) or multiplies (negative) the logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits (OpenAI's range: -100 to 100)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # vLLM's: words never generated (a word's last token is banned right after the rest of it)
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set from the tokenizer (update_from_tokenizer)
    # vLLM's: only the prompt's last k tokens are kept (-1: as many as the model's context holds)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> SamplingParamError:
            return SamplingParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (or -1 for off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.logit_bias and any(not isinstance(t, int) or t < 0 or not -100 <= b <= 100
                                   for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-empty strings")
        if not valid_truncation(self.truncate_prompt_tokens):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 for the model's context")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize ``bad_words`` as vLLM does: each word alone, and after a space when that is
        another token sequence of the same length (a word at the text's start and mid-text)."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        ids: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise SamplingParamError("bad_words", f"bad_words: {word!r} is no token")
            ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        self.bad_words_token_ids = ids

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
