"""deploy/ against a live server: every metric the dashboard, the rules, the manifests and the
prometheus-adapter name exists on /metrics; and the acceptance run: a real Prometheus (the
Debian package) scrapes the server under traffic, and every dashboard query, recording rule
and adapter query returns data through Prometheus's HTTP API (deploy/dashboard_demo.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from prometheus_bin import prometheus_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NAME = re.compile(r"expresslane:[a-z_][A-Za-z0-9_:]*")  # not an image tag (expresslane:0.1.0)


def named_metrics() -> dict[str, set[str]]:
    """File -> the expresslane metric names its queries use (recording rules included)."""
    files = [DEPLOY / "grafana" / "expresslane.json", DEPLOY / "prometheus" / "rules.yml",
             *sorted((DEPLOY / "kubernetes").glob("*.yaml"))]
    out = {}
    for f in files:
        names = set(NAME.findall(f.read_text()))
        if names:
            out[f.relative_to(ROOT).as_posix()] = names
    return out


SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def live_names(text: str) -> set[str]:
    """Sample names, and those of families declared without samples yet (a histogram before its
    first observation, the GPU gauges on a CPU server)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names |= {family + suffix for suffix in SUFFIXES.get(kind, ("",))}
    return names


def test_every_metric_named_in_deploy_exists_on_a_live_server(server):
    live = live_names(httpx.get(server.url + "/metrics").text)
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    recorded = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    named = named_metrics()
    assert {"deploy/grafana/expresslane.json", "deploy/prometheus/rules.yml", "deploy/kubernetes/hpa.yaml",
            "deploy/kubernetes/prometheus-adapter-values.yaml"} <= set(named)
    for f, names in named.items():
        unknown = names - live - recorded
        assert not unknown, f"{f} names metrics the server does not expose: {sorted(unknown)}"
    assert "expresslane:gpu_utilization_perc" in live  # declared, even with no sample on a CPU server
    assert not live_names("expresslane:not_a_metric 1\n") & live  # the check can fail


def test_dashboard_rules_and_adapter_have_data_on_a_real_prometheus(server, tmp_path):
    prometheus_binary("prometheus")
    png = tmp_path / "dashboard.png"
    r = subprocess.run([sys.executable, str(DEPLOY / "dashboard_demo.py"), "--base-url", server.url, "--api-key",
                        server.api_key, "--duration", "10", "--users", "6", "--check", "--output", str(png)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["missing"] == []
    dashboard = json.loads((DEPLOY / "grafana" / "expresslane.json").read_text())
    assert len(report["panels"]) == sum(len(p["targets"]) for p in dashboard["panels"])
    assert {p["panel"] for p in report["panels"]} == {p["title"] for p in dashboard["panels"]}
    assert all(p["series"] > 0 for p in report["panels"] if "gpu_" not in p["expr"])
    assert [q["record"] for q in report["rules"]] and all(q["series"] > 0 for q in report["rules"])
    assert report["adapter"] and all(q["series"] > 0 for q in report["adapter"])
    assert set(report["rule_health"].values()) == {"ok"}
    assert report["statuses"].get("200", 0) > 0 and report["statuses"].keys() & {"400", "404"}
    assert png.stat().st_size > 10_000
