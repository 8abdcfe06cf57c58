"""The container recipe and the Kubernetes manifests fit together: the container's flags parse
with the real `expresslane serve` parser and validate, probes hit /health on the named port,
the Service, ServiceMonitor, HPA and prometheus-adapter point at each other, and the drain
fits in the grace period. (That every metric they name exists: tests/server/test_deploy_live.py.)"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from expresslane.cli.main import build_parser
from expresslane.config import EngineConfig, engine_kwargs_from_args
from expresslane.config.flags import from_args
from expresslane.config.server import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if "kind" in doc:
            out[doc["kind"]] = doc
    return out


def container(objects) -> dict:
    [c] = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def serve_args(objects):
    c = container(objects)
    assert c["args"][0] == "serve"
    return build_parser().parse_args(c["args"])


def serve_config(objects) -> tuple[ServerConfig, EngineConfig]:
    """The container's `serve` flags as the server and the engine read them (validated)."""
    args = serve_args(objects)
    server = from_args(ServerConfig, args)
    server.validate()
    return server, EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


def test_kustomization_lists_every_manifest(objects):
    kustomization = load("kustomization.yaml")
    listed = set(kustomization["resources"])
    manifests = {p.name for p in K8S.glob("*.yaml") if "kind" in yaml.safe_load(p.read_text())} - {
        "kustomization.yaml"}
    assert listed == manifests
    assert set(objects) >= {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "HorizontalPodAutoscaler"}


def test_container_flags_parse_and_validate(objects):
    settings, _ = serve_config(objects)
    assert settings.listen.host == "0.0.0.0"
    assert settings.listen.port == container(objects)["ports"][0]["containerPort"]
    assert settings.api_key == "$(EXPRESSLANE_API_KEY)"  # Kubernetes fills it from the env var
    assert {e["name"] for e in container(objects)["env"]} >= {"EXPRESSLANE_API_KEY"}


def test_probes_hit_health_on_the_named_port(objects):
    c = container(objects)
    ports = {p["name"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
        assert c[probe]["httpGet"]["port"] in ports, probe


def test_drain_fits_the_grace_period_and_liveness_spares_it(objects):
    (settings, _), c = serve_config(objects), container(objects)
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + settings.shutdown_timeout
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > settings.shutdown_timeout  # /health is 503 while draining


def test_service_and_servicemonitor_select_the_pods(objects):
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert objects["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = objects["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in container(objects)["ports"]}
    assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    sm = objects["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"


def test_hpa_scales_the_deployment_on_the_adapters_metric_below_the_slo(objects):
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", objects["Deployment"]["metadata"]["name"])
    [m] = hpa["spec"]["metrics"]
    [rule] = load("prometheus-adapter-values.yaml")["rules"]["custom"]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == rule["name"]["as"]
    series = rule["seriesQuery"].partition("{")[0]
    assert re.fullmatch(rule["name"]["matches"], series)
    recorded = {r.get("record") for g in yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())["groups"]
                for r in g["rules"]}
    assert series in recorded
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    target = m["pods"]["target"]["averageValue"]
    target_s = float(target[:-1]) / 1000 if target.endswith("m") else float(target)
    assert target_s < serve_config(objects)[1].scheduler.lane_slo["interactive"].ttft


def test_dockerfile_builds_what_it_runs(objects):
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    for line in lines:
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for s in sources:
                assert (ROOT / s).exists(), s
    installs = [line for line in lines if line.startswith("RUN pip install \".[")]
    extras = re.findall(r"\.\[([a-z,]+)\]", " ".join(installs))
    assert extras == ["server"]
    assert "server" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    entry = [shlex.split(line.partition(" ")[2].strip("[]").replace(",", " ")) for line in lines
             if line.startswith(("ENTRYPOINT", "CMD"))]
    command = [w for part in entry for w in part]
    assert command[:2] == ["expresslane", "serve"]
    listen = from_args(ServerConfig, build_parser().parse_args(command[1:])).listen
    assert listen.host == "0.0.0.0" and listen.port == container(objects)["ports"][0]["containerPort"]
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert "*" in ignore and {"!expresslane/", "!pyproject.toml", "!README.md"} <= set(ignore)
