"""The Prometheus rules: promtool checks them and runs their unit tests; the Kubernetes
PrometheusRule carries exactly the same groups."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from prometheus_bin import prometheus_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_binary("promtool"), *args], capture_output=True, text=True, timeout=120,
                          cwd=DEPLOY / "prometheus")


def test_promtool_check_rules():
    r = promtool("check", "rules", "rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def test_promtool_test_rules():
    r = promtool("test", "rules", "rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if not t["exp_alerts"]}
    assert alerts == fired == quiet  # each alert is tested both firing and not firing


def test_a_broken_rule_fails_its_test(tmp_path):
    """The unit tests can fail: a KV threshold of 0.99 does not fire at 97%."""
    (tmp_path / "rules.yml").write_text((DEPLOY / "prometheus" / "rules.yml").read_text()
                                        .replace("expresslane:kv_cache_usage_perc > 0.95",
                                                 "expresslane:kv_cache_usage_perc > 0.99"))
    (tmp_path / "rules_test.yml").write_text((DEPLOY / "prometheus" / "rules_test.yml").read_text())
    r = subprocess.run([prometheus_binary("promtool"), "test", "rules", "rules_test.yml"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "ExpresslaneKVCacheNearFull" in r.stdout + r.stderr


def test_prometheusrule_carries_the_same_groups():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    cr = yaml.safe_load((DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text())
    assert cr["apiVersion"] == "monitoring.coreos.com/v1" and cr["kind"] == "PrometheusRule"
    assert cr["spec"]["groups"] == rules["groups"]
