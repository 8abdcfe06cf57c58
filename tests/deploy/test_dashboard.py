"""The Grafana dashboard's shape: the panels the issue asks for, each target filtered by the
model variable on the datasource variable, a grid without overlaps. (Its queries run against a
real Prometheus in tests/server/test_deploy_live.py.)"""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "expresslane.json").read_text())
PANELS = DASHBOARD["panels"]


def test_the_asked_for_panels_are_there():
    titles = " | ".join(p["title"] for p in PANELS)
    for words in ("Time to first token", "Inter-token latency", "End-to-end request latency", "requests/s",
                  "Errors/s", "waiting and running", "KV cache usage and prefix cache hit rate", "Preemptions/s",
                  "Tokens/s", "GPU utilisation", "step-cost model"):
        assert words in titles, words
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency"):
        [panel] = [p for p in PANELS if p["title"].startswith(title)]
        exprs = [t["expr"] for t in panel["targets"]]
        for q in ("0.5", "0.95", "0.99"):  # p50 / p95 / p99 per lane
            assert any(e.startswith(f"histogram_quantile({q}, sum by (lane, le)") for e in exprs), (title, q)


def test_targets_use_the_variables():
    names = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert names == {"datasource", "model_name"}
    for p in PANELS:
        assert p["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(set(ref_ids)) == len(ref_ids), p["title"]
        for t in p["targets"]:
            assert 'model_name=~"$model_name"' in t["expr"], (p["title"], t["expr"])
            assert "[" not in t["expr"] or "[$__rate_interval]" in t["expr"], t["expr"]


def test_grid_has_no_overlaps_and_unique_ids():
    assert len({p["id"] for p in PANELS}) == len(PANELS)
    cells = set()
    for p in PANELS:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
