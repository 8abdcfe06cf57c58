"""A byte-level BPE tokenizer of any vocabulary size, built offline in about a second.

Layout of the ids (``V`` = vocab_size)::

    0 .. 255          one token per byte (GPT-2's printable byte alphabet): any text encodes
    256 .. V-5        merged tokens, most likely English strings first
    V-4 .. V-1        <|begin_of_text|> <|end_of_text|> <|im_start|> <|im_end|>

(gpt-oss's: the top ids are harmony's special tokens instead, models/harmony.py, with its
chat template.)

Merged tokens are the most probable strings under a unigram model of English
characters, enumerated best-first. A string is only ever added after its prefix,
so the merge ``(prefix, last char)`` always joins two existing tokens. Strings
follow the shape of GPT-2's pre-tokenizer pieces (an optional leading space, then
a run of letters, digits, punctuation or whitespace), so almost every merge can
fire on real text. Chats use ChatML; the tokenizer adds ``<|begin_of_text|>`` in
front of each encoded text, like Llama 3.
"""

from __future__ import annotations

import heapq
import json
import math
import pathlib
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Relative frequencies (per mille of English text, roughly); only the order matters much.
_LOWER_FREQ = dict(zip("etaoinshrdlcumwfgypbvkjxqz",
                       (127, 91, 82, 75, 70, 67, 63, 61, 60, 43, 40, 28, 28, 24, 24, 22, 20, 20, 19, 15,
                        10, 8, 1.5, 1.5, 1, 0.7)))
_SPACE, _NEWLINE, _TAB = "Ġ", "Ċ", "ĉ"  # " ", "\n", "\t" in the byte alphabet


def special_token_ids(vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS) -> dict[str, int]:
    """Ids of the special tokens: the top of the vocabulary."""
    first = vocab_size - len(specials)
    return {token: first + i for i, token in enumerate(specials)}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _char_classes() -> dict[str, list[tuple[str, float]]]:
    """Characters of each pre-token class with their log-probabilities, likeliest first."""
    weights = {"letter": {**_LOWER_FREQ, **{c.upper(): f / 10 for c, f in _LOWER_FREQ.items()}},
               "digit": {d: 5.0 for d in string.digits},
               "punct": {p: 2.0 if p in ".,'\"-()" else 0.5 for p in string.punctuation},
               "space": {_SPACE: 180.0, _NEWLINE: 20.0, _TAB: 2.0}}
    total = sum(w for cls in weights.values() for w in cls.values())
    return {name: sorted(((c, math.log(w / total)) for c, w in cls.items()), key=lambda cw: (-cw[1], cw[0]))
            for name, cls in weights.items()}


def _likely_merges(count: int) -> list[tuple[str, str]]:
    """The ``count`` likeliest strings of length >= 2, each as its merge (prefix, last char).

    Lazy best-first enumeration of a tree whose children are sorted by probability:
    popping a string pushes only its first child and its next sibling, so the work is
    O(count log count) rather than O(count * alphabet).
    """
    classes = _char_classes()
    class_of = {c: name for name, chars in classes.items() for c, _ in chars}
    after_space = sorted((cw for chars in classes.values() for cw in chars), key=lambda cw: (-cw[1], cw[0]))
    logp_of = {c: lp for chars in classes.values() for c, lp in chars}  # grows with each popped string

    def children(s: str) -> list[tuple[str, float]]:
        return after_space if s == _SPACE else classes[class_of[s[-1]]]

    heap: list[tuple[float, str, str, int]] = []  # (-log p, string, parent, index among parent's children)

    def push_child(parent: str, index: int) -> None:
        kids = children(parent)
        if index < len(kids):
            c, lp = kids[index]
            heapq.heappush(heap, (-(logp_of[parent] + lp), parent + c, parent, index))

    for c in list(logp_of):
        push_child(c, 0)
    merges = []
    while len(merges) < count:
        neg_lp, s, parent, index = heapq.heappop(heap)
        logp_of[s] = -neg_lp
        merges.append((parent, s[len(parent):]))
        push_child(s, 0)
        push_child(parent, index + 1)
    # BPE fires the best-ranked merge anywhere in a word first. Ranking word-initial
    # merges first makes a word grow from its start ("Ġt", "Ġth", "Ġthe") instead of
    # being cut by a likelier inner pair ("Ġt" + "he"). Prefixes still precede extensions.
    return sorted(merges, key=lambda m: not m[0].startswith(_SPACE))


def build_tokenizer(vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids; the first special token is
    the one put in front of each encoded text."""
    n_merges = vocab_size - 256 - len(specials)
    if n_merges < 0:
        raise ValueError(f"vocab_size must be at least {256 + len(specials)}, got {vocab_size}")
    merges = _likely_merges(n_merges)
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    vocab.update({a + b: 256 + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))  # appended after the BPE vocab: the top ids
    bos = specials[0]
    bos_id = special_token_ids(vocab_size, specials)[bos]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]),
    ])
    return tok


def save_tokenizer(vocab_size: int, out_dir: pathlib.Path, model_max_length: int, harmony: bool = False) -> None:
    """Write tokenizer.json and tokenizer_config.json, loadable by ``AutoTokenizer``; `harmony`:
    gpt-oss's special tokens and chat template."""
    from expresslane.models import harmony as h

    specials = h.SPECIAL_TOKENS if harmony else SPECIAL_TOKENS
    build_tokenizer(vocab_size, specials).save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0],
        "eos_token": h.RETURN if harmony else EOS,
        "pad_token": h.ENDOFTEXT if harmony else EOS,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # decode must give back the exact text
        "chat_template": h.CHAT_TEMPLATE if harmony else CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
