"""Expert load in /metrics on a live server with a mixture of experts (tiny Mixtral: 5 experts,
top-2, 2 layers): per-expert token counters that move under traffic by exactly the tokens
computed x top-k per layer, and a per-layer imbalance gauge."""

from __future__ import annotations

from openai import OpenAI

from .conftest import API_KEY, Server, metric

EXPERTS, TOP_K, LAYERS = 5, 2, 2
TOKENS = "expresslane:moe_expert_tokens_total"


def _scrape_until_moved(server: Server, before: float) -> dict[str, float]:
    """The counters are published when the engine goes idle after the request, with the step
    that finished it: at most a few scrapes after the response."""
    for _ in range(200):
        m = server.metrics()
        if metric(m, TOKENS) != before:
            return m
    return m


def test_expert_load_moves_under_traffic(model_dirs):
    server = Server(str(model_dirs["mixtral"])).wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        start = server.metrics()
        series = {k for k in start if k.startswith(TOKENS)}
        assert metric(start, TOKENS) == 0, "start-up steps (profiling, calibration) are not counted"
        computed = 0
        last = {layer: [0] * EXPERTS for layer in range(LAYERS)}
        for prompt, max_tokens in (("The quick brown fox", 8), ("Mixture of experts routes each token", 5)):
            before = metric(server.metrics(), TOKENS)
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            # every prompt token and every sampled token but the last went through each layer once
            computed += r.usage.prompt_tokens + r.usage.completion_tokens - 1
            after = _scrape_until_moved(server, before)
            for layer in range(LAYERS):
                per_expert = [metric(after, TOKENS, layer=str(layer), expert=str(e)) for e in range(EXPERTS)]
                assert sum(per_expert) == computed * TOP_K, (layer, per_expert, computed)
                # busiest over mean, in this request's tokens (one update per request: it ends idle)
                window = [now - then for now, then in zip(per_expert, last[layer])]
                imbalance = metric(after, "expresslane:moe_expert_load_imbalance", layer=str(layer))
                assert imbalance == max(window) * EXPERTS / sum(window) and 1.0 <= imbalance <= EXPERTS / TOP_K
                last[layer] = per_expert
        assert len({k for k in after if k.startswith(TOKENS)}) == EXPERTS * LAYERS > len(series)
    finally:
        server.stop()
