"""``bench report``: every result kind, a PNG that says what ran and how it went, failures drawn
as failures."""

from __future__ import annotations

import json
import re

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from expresslane.bench import charts, tables
from expresslane.bench.records import RequestRecord
from expresslane.bench.slo import judge, parse_slo
from expresslane.bench.stats import measurement

from .conftest import bench


def test_png_has_real_content(result_files, tmp_path):
    out = tmp_path / "chart.png"
    assert bench("report", *map(str, result_files.values()), "--output", str(out)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(out)
    h, w = img.shape[:2]
    assert h > 500 and w > 500
    rgb = img[..., :3]
    assert rgb.std() > 0.05  # not a blank canvas
    assert (rgb < 0.5).mean() > 0.01  # some dark pixels: lines, text, axes


def test_png_header_names_the_run_its_failures_and_verdict(result_files):
    r = json.loads(result_files["serving"].read_text())
    [head, tail] = tables.run_summary("mix", r)
    assert head.startswith("mix: serving, model fake-model at http://") and "dataset mixed" in head
    assert "concurrency 8" in head
    assert tail.strip().startswith(f"{r['failed']} of 40 requests failed; SLO FAIL: failure_rate")
    sweep = tables.run_summary("s", json.loads(result_files["sweep"].read_text()))
    assert "past saturation at max_concurrency=4" in sweep[0] and "SLO per point" in sweep[2]


def test_every_result_kind_is_reported(result_files, tmp_path):
    flat = tmp_path / "flat.json"
    one = tmp_path / "one.json"
    flat.write_text(json.dumps({
        "kind": "flat-latency", "base_url": "http://x", "model_id": "m", "device": None, "dtype": None,
        "num_threads": 1, "num_short": 2, "short_len": 8, "long_len": 64, "output_len": 2, "repeats": 1,
        "input_lens": [8, 64], "notices": [],
        "rows": [{"mode": "server", "ttft_alone_ms": [{"input_len": 8, "ttft_ms": 5.0},
                                                      {"input_len": 64, "ttft_ms": None}],
                  "short_alone_ttft_ms": 5.0, "short_mixed_ttft_ms": 20.0, "long_mixed_ttft_ms": 19.0,
                  "flatness": 4.0, "failed": 1, "errors": ["HTTP 400: too long"]}]}))
    one.write_text(json.dumps({
        "kind": "one-batch", "model_id": "m", "device": "cpu", "device_name": None, "dtype": "float32",
        "batch_size": 2, "input_len": 8, "output_len": 3, "quantization": {"method": "none"},
        "prefill_latency_ms": 3.0, "prefill_throughput": 5.0, "median_decode_step_ms": 1.0,
        "decode_throughput": 2000.0, "total_latency_ms": 5.0, "step_latencies_ms": [3.0, 1.0, 1.0],
        "weight_bytes": 10, "mean_kv_bytes_per_step": 1.0, "achieved_bandwidth": 1.0,
        "peak_bandwidth": None, "bandwidth_utilization": None, "floor_step_ms": None,
        "fraction_of_floor": None}))
    html = tmp_path / "all.html"
    files = [*map(str, result_files.values()), str(flat), str(one)]
    assert bench("report", *files, "--output", str(html)) == 0
    page = html.read_text()
    for text in ("Flat latency (a)", "One batch: step latencies", "flatness", "One-Batch Benchmark Result",
                 "HTTP 400: too long", "flat: flat-latency, model m (http://x)"):
        assert text in page, text
    assert bench("report", str(flat), str(one), "--output", str(tmp_path / "k.png")) == 0


def failing_class_result() -> dict:
    ok = [RequestRecord(10, i, i + 0.1, True, 4, 0.02, [0.01] * 3, 0.05, "", "short") for i in range(6)]
    bad = [RequestRecord(3000, i, i + 0.01, False, 0, 0.0, [], 0.0, "HTTP 400: too long", "long")
           for i in range(4)]
    r = {"kind": "serving", "request_rate": "inf", "max_concurrency": None, "base_url": "u",
         **measurement(ok + bad, 10.0, 0.0)}
    r["slo"] = judge(r, parse_slo(None))
    return r


def test_failures_are_drawn_as_failures_not_zero_ms():
    r = failing_class_result()
    fig = Figure()
    ax = fig.add_subplot()
    charts.ttft_cdf(ax, [("run", r)])
    [line] = ax.get_lines()
    assert max(line.get_ydata()) == pytest.approx(0.6)  # 6 of 10 ever got a first token
    assert "(4 of 10 failed)" in line.get_label()
    ax = fig.add_subplot()
    charts.per_class(ax, [("run", r)])
    heights = {t.get_text(): p.get_height() for t, p in zip(ax.get_xticklabels(), ax.patches)}
    assert heights["long"] != heights["long"]  # NaN: no bar for a class that failed 4 of 4
    assert any("all failed" in t.get_text() for t in ax.texts)


def test_a_traffic_run_appears_once_in_the_class_chart(result_files):
    r = json.loads(result_files["traffic"].read_text())
    assert {"lane:interactive", "lane:batch", "short", "long"} <= set(r["per_class"])
    assert charts.chart_classes(r) == ["lane:batch", "lane:interactive"]  # each request in one class
    ax = Figure().add_subplot()
    charts.per_class(ax, [("t", r)])
    assert len(ax.patches) == 2


def test_html_bundles_tables_and_images(result_files, tmp_path):
    out = tmp_path / "report.html"
    files = [str(result_files["serving"]), str(result_files["sweep"]),
             str(result_files["traffic"])]
    assert bench("report", *files, "--output", str(out), "--compare",
                 "--labels", "mix,sweep,users") == 0
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 8  # every request chart applies to one of the three kinds
    assert all(len(data) > 5000 for data in images)
    assert page.count("<table>") > 10
    for text in ("Comparison", "mix", "sweep over max_concurrency", "past saturation",
                 "mean TTFT", "p99 (ms)", "SLO", "TTFT CDF", "Traffic: TTFT over time",
                 "lane:batch", "HTTP 500: injected failure"):
        assert text in page, text
    assert not re.search(r'(src|href)="(?!data:)', page)  # self-contained: no links out


def test_report_rejects_unknown_output(result_files, tmp_path):
    assert bench("report", str(result_files["serving"]), "--output",
                 str(tmp_path / "x.pdf")) == 2
