"""The accuracy report (expresslane.bench.accuracy): its invariants on known cases."""

from __future__ import annotations

import math

import pytest

from expresslane.bench.accuracy import quantization_accuracy


def test_the_unquantized_model_against_itself_agrees_exactly(llama_dir):
    r = quantization_accuracy(str(llama_dir), None, num_texts=2, text_len=24, prompt_len=4, trials=2)
    assert r["top1_agreement"] == {"mean": 1.0, "stderr": 0.0}
    assert abs(r["kl_divergence"]["mean"]) < 1e-6 and r["perplexity_diff"]["mean"] == 0.0
    assert len(r["per_text"]) == 4 and all(t["accuracy_base"] == t["accuracy_quant"] for t in r["per_text"])
    for key in ("weight_bytes", "kv_bytes_per_token", "kv_cache_dtype"):  # (the baseline's cache is larger: it
        assert r["memory"]["baseline"][key] == r["memory"]["quantized"][key]  # also writes the texts)


def test_given_texts_are_split_across_trials_and_fp8_costs_something(llama_dir):
    texts = [[(7 * i + 3 * j) % 500 for j in range(30)] for i in range(4)]
    r = quantization_accuracy(str(llama_dir), "fp8", texts=texts, trials=2)
    assert r["texts_per_trial"] == 2 and {t["trial"] for t in r["per_text"]} == {0, 1}
    assert 0.5 < r["top1_agreement"]["mean"] <= 1.0 and r["kl_divergence"]["mean"] > 0
    # perplexity is exp(mean NLL) of the actual next tokens, per model
    assert math.isclose(r["per_trial"][0]["perplexity_diff"],
                        r["per_trial"][0]["perplexity_quant"] - r["per_trial"][0]["perplexity_base"])
    assert r["memory"]["quantized"]["weight_bytes"] < r["memory"]["baseline"]["weight_bytes"]
    with pytest.raises(ValueError, match="cannot be split"):
        quantization_accuracy(str(llama_dir), "fp8", texts=texts[:1], trials=2)
