"""What quantization costs in accuracy: a quantized engine against the unquantized model on
the same token sequences, teacher-forced (every position predicts the next token of a fixed
text, so one divergence does not derail the rest).

    from expresslane.bench.accuracy import quantization_accuracy
    report = quantization_accuracy("MODEL_DIR", quantization="fp8", trials=5)

Per trial: ``num_texts`` texts of ``text_len`` tokens (trial t uses seed t); per text and
model the next-token distributions at every position. Figures per trial are means over all
positions of all texts; the report gives each as mean ± standard error over trials:

- ``top1_agreement``: the two models' argmax tokens agree;
- ``kl_divergence``: KL(p_base || p_quant), nats;
- ``perplexity`` of each model on the texts, and the difference (quantized - base).

Texts: given ones (token ids), or by default sampled from the unquantized model itself at
temperature 1 from a random prompt of ``prompt_len`` tokens: text the model finds plausible
(random-weight models have no real text). Random weights make agreement nearly meaningless
as a quality figure; with a trained model the same report measures real damage.
Also per text ("per-prompt accuracy"): the fraction of next tokens each model predicts
top-1, before and after quantization; and the standard error against the number of trials.
"""

from __future__ import annotations

import math
import random
import statistics

import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.config.engine import CacheConfig
from expresslane.config.flags import default_of

DEFAULTS = dict(num_texts=8, text_len=256, prompt_len=16, trials=3)


def sequence_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] of one sequence, prefilled at once into an idle engine's KV
    blocks 0.. (the engine must run without prefix caching: the blocks are overwritten)."""
    bs, n, dev = llm.config.cache.block_size, len(token_ids), torch.device(llm.config.device.device)
    blocks, have = -(-n // bs), llm.config.cache.num_kv_blocks
    if blocks > have:
        raise ValueError(f"a text of {n} tokens needs {blocks} KV blocks; the engine has {have}")
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        num_decodes=0, seq_lens_cpu=[n], query_start_loc_cpu=[0, n], max_decode_seq_len=0,
        rope_lengths=torch.full((n,), n, device=dev))  # one prompt, as transformers sees it

    @torch.inference_mode()
    def forward(model) -> torch.Tensor:
        model.layers[0].self_attn.backend.prepare(meta)
        hidden = model(torch.tensor(token_ids, device=dev), torch.arange(n, device=dev), meta)
        return model.compute_logits(hidden).float()

    [logits] = llm.apply_model(forward)
    return logits


def compare(base_logits: torch.Tensor, quant_logits: torch.Tensor, token_ids: list[int]) -> dict:
    """Teacher-forced figures of one text: positions 0..T-2 predict tokens 1..T-1."""
    a, b = base_logits[:-1], quant_logits[:-1]
    target = torch.tensor(token_ids[1:], device=a.device)
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    nll_a = -la.gather(1, target[:, None]).squeeze(1)
    nll_b = -lb.gather(1, target[:, None]).squeeze(1)
    return {"positions": len(target),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "kl_divergence": kl.mean().item(),
            "nll_base": nll_a.mean().item(), "nll_quant": nll_b.mean().item(),
            "accuracy_base": (a.argmax(-1) == target).float().mean().item(),
            "accuracy_quant": (b.argmax(-1) == target).float().mean().item()}


def sample_texts(llm, num: int, prompt_len: int, text_len: int, seed: int) -> list[list[int]]:
    """Texts the base model writes itself: a random prompt continued at temperature 1 (seeded)."""
    from expresslane import SamplingParams

    vocab = llm.engine.core.hf_config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num)]
    params = [SamplingParams(temperature=1.0, max_tokens=text_len - prompt_len, ignore_eos=True, seed=seed * 1000 + i)
              for i in range(num)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def _mean_se(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": mean, "stderr": se}


def memory_report(llm) -> dict:
    """Bytes of weights and KV cache (per token, and allocated) of an engine."""
    runner = llm.engine.runner
    [weights] = llm.apply_model(lambda model: sum(p.numel() * p.element_size() for p in model.parameters()))
    kv_block, cache = runner.kv_block_bytes(), llm.config.cache
    return {"device": llm.config.device.device, "weight_bytes": weights,
            "kv_bytes_per_token": kv_block // cache.block_size, "kv_cache_bytes": kv_block * cache.num_kv_blocks,
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch.")}


def _engine(model: str | None, blocks: int, **kwargs):
    from expresslane import LLM

    return LLM(model, enable_prefix_caching=False, num_kv_blocks=blocks, max_num_seqs=16,
               enforce_eager=True, **kwargs)


def quantization_accuracy(model: str | None, quantization: str | None = None, *, baseline_model: str | None = None,
                          texts: list[list[int]] | None = None, num_texts: int = DEFAULTS["num_texts"],
                          text_len: int = DEFAULTS["text_len"], prompt_len: int = DEFAULTS["prompt_len"],
                          trials: int = DEFAULTS["trials"],
                          kv_cache_dtype: str = default_of(CacheConfig, "kv_cache_dtype"), **engine_args) -> dict:
    """The accuracy report of `model` under `quantization` (and/or an FP8 KV cache) against
    `baseline_model` (default: `model` unquantized). Both engines stay loaded side by side
    with small KV caches (one text at a time)."""
    if trials < 1 or num_texts < 1 or text_len < prompt_len + 2:
        raise ValueError("trials and num_texts must be >= 1 and text_len >= prompt_len + 2")
    if texts is not None:
        if len(texts) < trials:
            raise ValueError(f"{len(texts)} texts cannot be split into {trials} trials")
        text_len = max(len(t) for t in texts)
    per_text_blocks = -(-text_len // 16) + 1  # (block_size 16, the engines' default)
    base = _engine(baseline_model or model, per_text_blocks * num_texts, max_model_len=text_len, **engine_args)
    quant = _engine(model, per_text_blocks, max_model_len=text_len, quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype, **engine_args)
    per_trial, per_text = [], []
    for trial in range(trials):
        # given texts: trial t takes every trials-th one (disjoint splits); else fresh samples per trial
        trial_texts = (texts[trial::trials] if texts is not None
                       else sample_texts(base, num_texts, prompt_len, text_len, trial))
        rows = [compare(sequence_logits(base, t), sequence_logits(quant, t), t) for t in trial_texts]
        per_text += [dict(r, trial=trial) for r in rows]
        total = sum(r["positions"] for r in rows)
        avg = {k: sum(r[k] * r["positions"] for r in rows) / total
               for k in ("top1_agreement", "kl_divergence", "nll_base", "nll_quant")}
        per_trial.append({"top1_agreement": avg["top1_agreement"], "kl_divergence": avg["kl_divergence"],
                          "perplexity_base": math.exp(avg["nll_base"]), "perplexity_quant": math.exp(avg["nll_quant"]),
                          "perplexity_diff": math.exp(avg["nll_quant"]) - math.exp(avg["nll_base"])})
    keys = per_trial[0].keys()
    agreement = [t["top1_agreement"] for t in per_trial]
    return {
        "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
        "baseline_model": str(base.engine.core.model_dir), "model": str(quant.engine.core.model_dir),
        "trials": trials, "texts_per_trial": len(per_text) // trials, "text_len": text_len,
        "texts": "given, split across trials" if texts is not None else f"sampled from the baseline (temperature 1, {prompt_len}-token "
                                                   "random prompts)",
        **{k: _mean_se([t[k] for t in per_trial]) for k in keys},
        "per_trial": per_trial,
        "per_text": per_text,
        # standard error of the mean agreement after the first n trials (n = 2..trials)
        "stderr_vs_trials": [{"trials": n, "top1_agreement": _mean_se(agreement[:n])["stderr"]}
                             for n in range(2, trials + 1)],
        "memory": {"baseline": memory_report(base), "quantized": memory_report(quant)},
    }


def format_accuracy(r: dict) -> str:
    def pm(x: dict, spec: str) -> str:
        se = "-" if x["stderr"] is None else format(x["stderr"], spec.lstrip("+"))
        return f"{format(x['mean'], spec)} ± {se}"

    mb, mq = r["memory"]["baseline"], r["memory"]["quantized"]
    rows = [
        ("Quantization / KV cache", f"{r['quantization'] or 'none'} / {r['kv_cache_dtype']}"),
        ("Trials x texts x tokens", f"{r['trials']} x {r['texts_per_trial']} x {r['text_len']}"),
        ("Top-1 agreement", pm(r["top1_agreement"], ".4f")),
        ("Mean KL (nats)", pm(r["kl_divergence"], ".5f")),
        ("Perplexity, baseline", pm(r["perplexity_base"], ".3f")),
        ("Perplexity, quantized", pm(r["perplexity_quant"], ".3f")),
        ("Perplexity difference", pm(r["perplexity_diff"], "+.4f")),
        ("Weights (MB), before -> after", f"{mb['weight_bytes'] / 1e6:,.1f} -> {mq['weight_bytes'] / 1e6:,.1f}"),
        ("KV bytes/token, before -> after", f"{mb['kv_bytes_per_token']:,} -> {mq['kv_bytes_per_token']:,}"),
    ]
    out = [f"{' Quantization Accuracy (teacher-forced, vs baseline) ':=^64}"]
    out += [f"{label + ':':<34}{value:>30}" for label, value in rows]
    out.append("=" * 64)
    return "\n".join(out)


def plot_accuracy(r: dict, path: str) -> None:
    """Two panels: per-text top-1 accuracy before/after quantization (histograms), and the
    standard error of the agreement against the number of trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    before = [t["accuracy_base"] for t in r["per_text"]]
    after = [t["accuracy_quant"] for t in r["per_text"]]
    bins = [i / 20 for i in range(21)]
    ax1.hist(before, bins=bins, alpha=0.6, label="before (baseline)")
    ax1.hist(after, bins=bins, alpha=0.6, label=f"after ({r['quantization'] or r['kv_cache_dtype']})")
    ax1.set(xlabel="per-text top-1 accuracy on the next token", ylabel="texts", title="Per-text accuracy")
    ax1.legend()
    pts = [(p["trials"], p["top1_agreement"]) for p in r["stderr_vs_trials"]]
    if pts:
        ax2.plot(*zip(*pts), marker="o")
    ax2.set(xlabel="trials", ylabel="standard error of top-1 agreement", title="Standard error vs trials")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
