"""Every HTTP bench subcommand against a real `expresslane serve` (tiny model)."""

from __future__ import annotations

import json

import pytest

from server.conftest import Server

from .conftest import bench
from .test_schema import check_result, load_strict


@pytest.fixture(scope="module")
def real_server():
    srv = Server(api_key=None).wait_ready()
    yield srv
    srv.stop()


def test_bench_subcommands_against_expresslane_serve(real_server, tmp_path):
    url = ["--base-url", real_server.url]
    serving, traffic, flat = tmp_path / "serving.json", tmp_path / "traffic.json", tmp_path / "flat.json"
    assert bench("serving", *url, "--disable-tqdm", "--dataset", "mixed", "--num-prompts", "12",
                 "--input-len", "16", "--long-input-len", "160", "--long-threshold", "100", "--output-len", "4",
                 "--concurrency", "4", "--ignore-eos", "--output", str(serving)) == 0
    r = load_strict(serving)
    check_result(r, "serving")
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 4  # usage from the server: exact counts

    assert bench("traffic", *url, "--disable-tqdm", "--num-users", "3", "--duration", "3", "--think-time", "0.1",
                 "--input-len", "16", "--output-len", "4", "--batch-input-len", "64", "--batch-output-len", "4",
                 "--output", str(traffic)) == 0
    t = load_strict(traffic)
    check_result(t, "traffic")
    assert t["completed"] > 0 and t["time_series"]

    assert bench("flat-latency", *url, "--input-lens", "8,64", "--num-short", "3", "--short-len", "8",
                 "--long-len", "150", "--repeats", "1", "--output", str(flat)) == 0
    f = json.loads(flat.read_text())
    assert f["target"] == "http" and f["rows"][0]["failed"] == 0

    html, png = tmp_path / "report.html", tmp_path / "chart.png"
    assert bench("report", str(serving), str(traffic), "--output", str(html)) == 0
    assert bench("report", str(serving), "--output", str(png)) == 0
    assert html.stat().st_size > 10_000 and "data:image/png;base64" in html.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
