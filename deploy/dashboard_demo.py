"""The dashboard on real data without Grafana: a real Prometheus (the repo's rules) scraping
a live ``expresslane serve``, mixed traffic, then every dashboard query and recording rule
evaluated through Prometheus's HTTP API and the panels drawn with matplotlib.

    python deploy/dashboard_demo.py --output docs/dashboard.png            # starts a tiny-model server
    python deploy/dashboard_demo.py --base-url http://127.0.0.1:8000 --api-key KEY --duration 120

Needs ``prometheus`` on PATH (Debian: ``apt-get install prometheus``). Prints a JSON report
(series per query); with ``--check`` exits 1 when a query that should have data has none
(the GPU panels need data only when the server exports GPU metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

import httpx

DEPLOY = Path(__file__).resolve().parent
DASHBOARD = DEPLOY / "grafana" / "expresslane.json"
RULES = DEPLOY / "prometheus" / "rules.yml"
ADAPTER = DEPLOY / "kubernetes" / "prometheus-adapter-values.yaml"
PREFIXES = ["You are a helpful assistant. Answer briefly. ", "Summarise the following text in one line: ",
            "Translate to French: "]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not after {timeout:g}s")


def dashboard_queries(rate_interval: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, with Grafana's variables filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel["targets"]:
            out.append((panel["title"], t["expr"].replace("$__rate_interval", rate_interval)
                        .replace('"$model_name"', '".*"'), t.get("legendFormat", "")))
    return out


def adapter_queries() -> list[tuple[str, str]]:
    """(custom metric, PromQL) as prometheus-adapter sends them for the demo's pod."""
    import yaml

    out = []
    for rule in yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]:
        series = rule["seriesQuery"].partition("{")[0]
        query = (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.GroupBy>>", "pod")
                 .replace("<<.LabelMatchers>>", 'namespace="demo",pod=~"expresslane-0"'))
        out.append((rule["name"]["as"], query))
    return out


def recorded_names() -> list[str]:
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["record"] for g in groups for r in g["rules"] if "record" in r]


class Prometheus:
    def __init__(self, target: str, workdir: Path, scrape_interval: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "expresslane", "static_configs": [
                      # the labels Kubernetes service discovery adds, so the rules' "by (namespace, pod)" keep them
                      {"targets": [target], "labels": {"namespace": "demo", "pod": "expresslane-0"}}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus not found on PATH (Debian: apt-get install prometheus)")
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: httpx.get(self.url + "/-/ready").status_code == 200, "prometheus ready", 60, self.proc)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": at} if at is not None else {})}
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=30).json()
        if r["status"] != "success":
            raise RuntimeError(f"{expr}: {r}")
        return r["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query_range", params={"query": expr, "start": start, "end": end,
                                                                 "step": step}, timeout=30).json()
        if r["status"] != "success":
            raise RuntimeError(f"{expr}: {r}")
        return r["data"]["result"]

    def caught_up(self, t: float) -> bool:
        """Whether the server was scraped, and every rule group evaluated, after time t."""
        up = self.query("timestamp(up)")
        groups = httpx.get(self.url + "/api/v1/rules", timeout=30).json()["data"]["groups"]
        evaluated = [datetime.fromisoformat(g["lastEvaluation"][:26].rstrip("Z")).replace(tzinfo=timezone.utc)
                     .timestamp() for g in groups]
        return bool(up) and float(up[0]["value"][1]) > t and bool(groups) and min(evaluated) > t

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def drive(base_url: str, headers: dict, duration: float, users: int, seed: int) -> dict[str, int]:
    """Closed-loop users on both lanes with shared prompt prefixes, and a few bad requests."""
    counts: dict[str, int] = {}
    stop_at = time.monotonic() + duration

    async def user(http: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(seed + i)
        lane = "batch" if i % 4 == 3 else "interactive"
        while time.monotonic() < stop_at:
            body = {"prompt": rng.choice(PREFIXES) + " ".join(rng.choice("abcdefgh") for _ in range(rng.randint(4, 40))),
                    "max_tokens": rng.randint(4, 48) * (3 if lane == "batch" else 1), "ignore_eos": True,
                    "lane": lane, "stream": rng.random() < 0.5}
            if rng.random() < 0.05:  # the errors panel needs errors
                body = rng.choice([{**body, "max_tokens": -1}, {**body, "model": "no-such-model"}])
            r = await http.post("/v1/completions", json=body)
            await r.aread()
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as http:
        await asyncio.gather(*(user(http, i) for i in range(users)))
    return counts


def render(prom: Prometheus, start: float, end: float, rate_interval: str, output: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = max(p["gridPos"]["y"] for p in panels) // 8 + 1
    fig = plt.figure(figsize=(15, 2.6 * rows + 0.8), facecolor="#111217")
    grid = fig.add_gridspec(rows, 2, hspace=0.55, wspace=0.12, left=0.05, right=0.98, top=1 - 0.9 / (2.6 * rows),
                            bottom=0.02)
    step = max(1.0, (end - start) / 300)
    queries = dashboard_queries(rate_interval)
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"] // 8, :] if pos["w"] == 24 else grid[pos["y"] // 8, pos["x"] // 12])
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#9fa2a7", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        unit = panel["fieldConfig"]["defaults"]["unit"]
        drawn = 0
        for title, expr, legend in queries:
            if title != panel["title"]:
                continue
            for series in prom.query_range(expr, start, end, step):
                ts = [float(t) - start for t, _ in series["values"]]
                vs = [float(v) * (100 if unit == "percentunit" else 1) for _, v in series["values"]]
                label = legend
                for k, v in series["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                ax.plot(ts, vs, linewidth=1.2, label=label,
                        linestyle="--" if label.startswith("SLO") else "-")
                drawn += 1
        if drawn:
            ax.legend(fontsize=6.5, loc="upper left", facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235",
                      ncol=3)
        else:
            ax.text(0.5, 0.5, "No data (no GPU on this machine)" if "GPU" in panel["title"] else "No data",
                    ha="center", va="center", color="#9fa2a7", transform=ax.transAxes)
        ax.set_ylabel({"s": "seconds", "percentunit": "%", "reqps": "req/s", "watt": "W"}.get(unit, ""),
                      color="#9fa2a7", fontsize=7)
        if panel["fieldConfig"]["defaults"]["custom"].get("scaleDistribution", {}).get("type") == "log":
            ax.set_yscale("log")  # as the Grafana panel: the SLO lines of both lanes fit
        ax.set_xlabel("seconds", color="#9fa2a7", fontsize=7)
        ax.grid(color="#2c3235", linewidth=0.5)
    fig.suptitle("expresslane dashboard: a matplotlib rendering of the Grafana panels' queries against a live "
                 "Prometheus (not a Grafana screenshot)\n" + subtitle, color="#d8d9da", fontsize=10)
    fig.savefig(output, dpi=60, facecolor=fig.get_facecolor())
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start `expresslane serve`)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scrape-interval", default="1s")
    p.add_argument("--rate-interval", default="10s", help="what $__rate_interval becomes")
    p.add_argument("--output", type=Path, default=None, help="write the rendered dashboard here (PNG)")
    p.add_argument("--check", action="store_true", help="exit 1 when a query that should have data has none")
    p.add_argument("serve_args", nargs="*", help="after --: flags for `expresslane serve` (without --base-url)")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with tempfile.TemporaryDirectory(prefix="expresslane-demo-") as tmp:
        server = None
        base_url = args.base_url
        if base_url is None:
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            server = subprocess.Popen([sys.executable, "-m", "expresslane.cli.main", "serve", "--port", str(port),
                                       *args.serve_args], stdout=open(Path(tmp) / "serve.log", "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True)
        prom = None
        try:
            wait_for(lambda: httpx.get(base_url + "/health").status_code == 200, "server ready", 300, server)
            prom = Prometheus(urlparse(base_url).netloc, Path(tmp), args.scrape_interval)
            wait_for(lambda: prom.query("up == 1"), "first scrape", 60)
            start = time.time()
            statuses = asyncio.run(drive(base_url, headers, args.duration, args.users, args.seed))
            end = time.time()
            # the rules are evaluated and the server scraped after the traffic's end
            wait_for(lambda: prom.caught_up(end), "a scrape and a rule evaluation after the traffic", 60)
            report = evaluate(prom, end - 1, args.rate_interval)
            report["statuses"] = statuses
            if args.output is not None:
                render(prom, start - 5, end + 2, args.rate_interval, args.output,
                       f"{args.duration:g} s of traffic, {sum(statuses.values())} requests, {args.users} users; "
                       f"$__rate_interval = {args.rate_interval}")
                report["output"] = str(args.output)
        finally:
            if prom is not None:
                prom.stop()
            if server is not None:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)
    print(json.dumps(report, indent=1))
    return 1 if args.check and report["missing"] else 0


def evaluate(prom: Prometheus, at: float, rate_interval: str) -> dict:
    """Series with a finite value per dashboard query, recording rule and prometheus-adapter query; which
    lack them; rule health."""
    def finite(results: list[dict]) -> int:
        return sum(math.isfinite(float(r["value"][1])) for r in results)

    gpu = bool(prom.query('{__name__=~"expresslane:gpu_.+"}', at))
    panels = [{"panel": title, "expr": expr, "series": finite(prom.query(expr, at))}
              for title, expr, _ in dashboard_queries(rate_interval)]
    rules = [{"record": name, "series": finite(prom.query(name, at))} for name in recorded_names()]
    adapter = [{"metric": name, "expr": expr, "series": finite(prom.query(expr, at))}
               for name, expr in adapter_queries()]
    groups = httpx.get(prom.url + "/api/v1/rules", timeout=30).json()["data"]["groups"]
    health = {r["name"]: r["health"] for g in groups for r in g["rules"]}
    missing = [q["expr"] for q in panels if not q["series"] and (gpu or "gpu_" not in q["expr"])]
    missing += [r["record"] for r in rules if not r["series"]]
    missing += [a["expr"] for a in adapter if not a["series"]]
    missing += [f"rule {n}: {h}" for n, h in health.items() if h != "ok"]
    return {"gpu_metrics": gpu, "panels": panels, "rules": rules, "adapter": adapter, "rule_health": health,
            "missing": missing}


if __name__ == "__main__":
    sys.exit(main())
