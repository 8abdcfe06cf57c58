"""Request bodies of the pooling endpoints (a server started with ``--runner pooling``), in
``protocol.py``'s terms (strict types, unknown fields refused by ``parse``):

- ``EmbeddingRequest``: OpenAI's ``POST /v1/embeddings`` (``input`` as a string, strings, token
  ids or lists of token ids; ``encoding_format``; ``dimensions``; ``user``), with vLLM's extras
  (``add_special_tokens``, ``normalize``, ``priority``) and our ``lane``.
- ``PoolingRequest``: vLLM's ``POST /pooling``: the same input, the vector as ``data``.
- ``ScoreRequest``: vLLM's ``POST /score``: ``text_1`` against ``text_2`` (one against many, or
  pairwise), scored by the cosine similarity of their embeddings.
- ``RerankRequest``: vLLM's ``POST /rerank`` (Jina's and Cohere's shape): ``query``, ``documents``,
  ``top_n``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from expresslane.server.protocol import _BODY, INT32, ChatMessage, List, NonEmptyStr, Truncation, template_kwargs

Input = str | List[str] | List[int] | List[List[int]]


class _PoolingBody(BaseModel):
    model_config = _BODY
    model: str | None = None
    add_special_tokens: bool = True  # vLLM's default for embeddings: the tokenizer's BOS/EOS added
    priority: int = Field(0, ge=-INT32, le=INT32)
    lane: Literal["interactive", "batch"] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    truncate_prompt_tokens: Truncation | None = None  # vLLM's: each input's last k tokens (-1: the context)


def inputs_of(value: Input) -> list[str | dict]:
    """The input(s) as ``InputProcessor.tokenize`` takes them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [{"prompt_token_ids": value}]
    return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in value]


class EmbeddingRequest(_PoolingBody):
    input: Input | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32)
    normalize: bool | None = None  # vLLM's: None takes the server's pooler config
    # vLLM's chat embeddings: the conversation through the chat template is the one input
    messages: List[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False  # (vLLM's default for embeddings)
    continue_final_message: bool = False
    chat_template: NonEmptyStr | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("must not be empty")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_names(cls, v: dict | None) -> dict | None:
        return template_kwargs(v)

    def refusal(self) -> tuple[str, str] | None:
        """(message, field) when the fields do not go together, else None."""
        if (self.input is None) == (self.messages is None):
            return "give either 'input' or 'messages' (a conversation, through the chat template)", "input"
        if self.messages is None:
            for name in ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if getattr(self, name):
                    return f"'{name}' needs 'messages'", name
        if self.continue_final_message and self.add_generation_prompt:
            return "'continue_final_message' needs add_generation_prompt: false", "continue_final_message"
        return None


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling body: an embeddings request whose answer names the vector ``data``."""


class ScoreRequest(_PoolingBody):
    text_1: NonEmptyStr | List[NonEmptyStr]
    text_2: NonEmptyStr | List[NonEmptyStr]

    @field_validator("text_1", "text_2")
    @classmethod
    def _non_empty_list(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v


class RerankRequest(_PoolingBody):
    query: NonEmptyStr
    documents: List[NonEmptyStr] = Field(min_length=1)
    top_n: int = Field(0, ge=0, le=INT32)  # 0: every document
    return_documents: bool = True
