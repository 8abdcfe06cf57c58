"""Train the built-in model pair: a BPE tokenizer and two Llama models (a ~9M target and a
~2M draft sharing its tokenizer) on the Python standard library's source, held-out split
kept aside (expresslane/bench/code_corpus.py). Written as Hugging Face directories
(config, bf16 safetensors, tokenizer, ChatML template, training.json with the recipe and
the held-out losses).

The shipped pair (expresslane/models/data/) was made on one H200 (2026-12-01, 2.7 min) from
CPython 3.11.7's stdlib copied there (the GPU machine's 3.12 has no test/ directory: 10.5 MB
of source instead of 31.5, and a run on it overfit) with:

    python3 benchmarks/train_pair.py --out OUT --stdlib python3.11 --max-epochs 10 \
        --target-seconds 120 --draft-seconds 60     # chose 1283 steps each

Held-out loss: target 2.352, draft 2.554 (nats per token, 91,804 held-out tokens).

With ``--*-seconds`` the step count is fixed after 30 timed steps so the run fits the time
(the count chosen is printed and saved in training.json: pass it as ``--target-steps`` /
``--draft-steps`` to repeat the run step for step). ``--tiny`` is the CI setting: a small
corpus, vocabulary and models, a few steps on the CPU (tests/test_train_pair.py).
The corpus is small (about 8.5M tokens), so steps are also capped at --max-epochs passes and
the weights kept are the ones with the best validation loss.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from expresslane.bench.code_corpus import SPLITS, stdlib_files, stdlib_root
from expresslane.models.tokenizer_builder import BOS, CHAT_TEMPLATE, EOS, IM_END, SPECIAL_TOKENS

SHAPES = {  # name: (hidden, layers, heads, kv_heads, intermediate); head_dim 64, tied embeddings
    "target": (256, 9, 4, 2, 768),
    "draft": (128, 4, 2, 1, 384),
    "tiny-target": (32, 2, 2, 1, 64),
    "tiny-draft": (16, 1, 1, 1, 32),
}
SAMPLE_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(directory):\n    \"\"\"Return the .py files under directory.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i, line in enumerate(lines):\n        if line.startswith(",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- tokenizer --------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text encodes); the special tokens take ids 0..3; BOS is added in front."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
              "model_max_length": max_len, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Every file as BOS + its tokens + EOS, concatenated."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts += [[bos], enc.ids, [eos]]
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


# -- model ------------------------------------------------------------------------------------
def build_model(shape: str, tok: Tokenizer, max_pos: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=max_pos, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tok.token_to_id(BOS),
                         eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(EOS))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int, amp) -> float:
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    windows = stream[: n * seq_len + 1]
    total = 0.0
    for i in range(0, n, 16):
        rows = torch.stack([windows[j * seq_len: (j + 1) * seq_len + 1] for j in range(i, min(n, i + 16))])
        with amp():
            total += loss_of(model, rows.long()).item() * len(rows)
    model.train()
    return total / max(1, n)


def train(model, name: str, train_stream: torch.Tensor, val_stream: torch.Tensor, args, steps: int | None,
          seconds: float | None, peak_lr: float) -> dict:
    """AdamW with warm-up and cosine decay; the weights kept are those with the best validation loss
    (checked every --eval-every steps: the corpus is small, a long run overfits it)."""
    device = train_stream.device
    amp = _amp(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    epoch_cap = max(1, int(args.max_epochs * len(train_stream) / (args.batch_size * args.seq_len)))
    total = min(steps or 10**9, epoch_cap)
    best = (math.inf, 0, None)  # validation loss, step, weights
    warmup = min(args.warmup, max(1, total // 10))
    calib_from, calib_to, t_calib = 10, 30, 0.0
    model.train()
    t0 = time.perf_counter()
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, peak_lr, warmup)
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), device=device,
                               generator=gen)
        batch = train_stream[starts[:, None] + torch.arange(args.seq_len + 1, device=device)].long()
        with amp():
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if seconds and step in (calib_from, calib_to):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == calib_from:
                t_calib = time.perf_counter()
            else:
                per_step = (time.perf_counter() - t_calib) / (calib_to - calib_from)
                left = seconds - (time.perf_counter() - t0)
                total = min(epoch_cap, steps or epoch_cap, max(calib_to + 1, calib_to + int(0.9 * left / per_step)))
                warmup = min(args.warmup, max(1, total // 10))
                log(f"{name}: {per_step * 1e3:.1f} ms/step, {total} steps to fit {seconds:.0f} s")
        if seconds and time.perf_counter() - t0 > 1.25 * seconds and step < total:
            log(f"{name}: stopping at step {step} of {total}: past 1.25x the time given")
            total = step
        if step % args.eval_every == 0 or step == total:
            val = held_out_loss(model, val_stream, args.seq_len, args.eval_windows, amp)
            if val < best[0]:
                best = (val, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            log(f"{name}: step {step}/{total} loss {loss.item():.3f} validation {val:.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e}")
    model.load_state_dict(best[2])
    return {"steps": total, "epochs": round(total * args.batch_size * args.seq_len / len(train_stream), 2),
            "seconds": round(time.perf_counter() - t0, 1), "best_step": best[1],
            "validation_loss": round(best[0], 4), "peak_lr": peak_lr, "warmup": warmup}


def _amp(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext


@torch.no_grad()
def samples(model, tok: Tokenizer, max_new_tokens: int) -> list[dict]:
    model.eval()
    device = next(model.parameters()).device
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids
        with _amp(device)():
            gen = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long, device=device), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.token_to_id(EOS))
        out.append({"prompt": prompt, "completion": tok.decode(gen[0, len(ids):].tolist())})
    model.train()
    return out


def save_model(model, tok: Tokenizer, out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    rope = config.get("rope_parameters") or {}  # transformers 5 writes rope_parameters; 4.x reads these two
    config |= {"rope_theta": rope.get("rope_theta", 10000.0), "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tok, out, model.config.max_position_embeddings)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="writes OUT/target and OUT/draft")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--target-seconds", type=float, default=None, help="fit the target's steps into this time")
    p.add_argument("--draft-seconds", type=float, default=None)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--max-epochs", type=float, default=8.0, help="at most this many passes over the training text")
    p.add_argument("--eval-every", type=int, default=100, help="validation every N steps (the best weights are kept)")
    p.add_argument("--eval-windows", type=int, default=256, help="validation / held-out windows of seq-len tokens")
    p.add_argument("--stdlib", type=Path, default=None, help="the stdlib directory to read (default: this Python's)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files of each split")
    p.add_argument("--tiny", action="store_true", help="CI: tiny models and vocabulary, CPU-sized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-tokens", type=int, default=48)
    args = p.parse_args(argv)
    if args.target_steps is None and args.target_seconds is None or args.draft_steps is None and \
            args.draft_seconds is None:
        p.error("give --target-steps or --target-seconds, and --draft-steps or --draft-seconds")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True

    files = {split: stdlib_files(split, args.stdlib)[: args.max_files] for split in SPLITS}
    log("corpus: " + ", ".join(f"{len(f)} {split} files ({sum(len(t) for _, t in f) / 1e6:.2f} MB)"
                               for split, f in files.items()))
    train_files = files["train"]
    tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    ids = {split: token_stream(tok, [t for _, t in f]) for split, f in files.items()}
    train_ids, held_ids = ids["train"], ids["held-out"]
    log(f"tokenizer: {tok.get_vocab_size()} ids; " + ", ".join(f"{len(v) / 1e6:.3f}M {k} tokens" for k, v in
        ids.items()) + f" ({sum(len(t) for _, t in train_files) / len(train_ids):.2f} chars/token)")
    train_stream, val_stream, held_stream = (torch.from_numpy(ids[s]).to(device) for s in SPLITS)

    for role, steps, seconds, lr in (("target", args.target_steps, args.target_seconds, args.target_lr),
                                     ("draft", args.draft_steps, args.draft_seconds, args.draft_lr)):
        shape = f"tiny-{role}" if args.tiny else role
        model = build_model(shape, tok, args.max_position_embeddings, args.seed).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"{role}: {n_params / 1e6:.2f}M parameters {SHAPES[shape]}")
        run = train(model, role, train_stream, val_stream, args, steps, seconds, lr)
        loss = held_out_loss(model, held_stream, args.seq_len, args.eval_windows, _amp(device))
        run |= {"held_out_loss": round(loss, 4), "held_out_tokens": int(min(len(held_ids),
                args.eval_windows * args.seq_len)), "parameters": n_params}
        log(f"{role}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}) after {run['steps']} steps, "
            f"{run['seconds']} s")
        done = samples(model, tok, args.sample_tokens)
        for s in done:
            log(f"{role} sample:\n--- prompt\n{s['prompt']}\n--- completion\n{s['completion']}\n---")
        record = {"role": role, "shape": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate"),
                                                  SHAPES[shape], strict=True)),
                  "corpus": f"{(args.stdlib or stdlib_root()).name} stdlib .py files, train split "
                            f"({len(train_files)} files, {len(train_ids)} tokens)",
                  "vocab_size": tok.get_vocab_size(), "seq_len": args.seq_len, "batch_size": args.batch_size,
                  "seed": args.seed, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  **run, "samples": done}
        save_model(model, tok, args.out / role, record)
        log(f"{role}: saved to {args.out / role}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
