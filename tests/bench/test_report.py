from __future__ import annotations

import re

from matplotlib.image import imread

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


def test_html_bundles_tables_and_images(result_files, tmp_path):
    out = tmp_path / "report.html"
    files = [str(result_files["serving"]), str(result_files["sweep"]),
             str(result_files["traffic"])]
    assert bench("report", *files, "--output", str(out), "--compare",
                 "--labels", "mix,sweep,users") == 0
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 8  # every chart applies to one of the three kinds
    assert all(len(data) > 5000 for data in images)
    assert page.count("<table>") > 10
    for text in ("Comparison", "mix", "sweep over max_concurrency", "past saturation",
                 "mean TTFT", "p99 (ms)", "SLO", "TTFT CDF", "Traffic: TTFT over time",
                 "lane:batch"):
        assert text in page, text
    assert not re.search(r'(src|href)="(?!data:)', page)  # self-contained: no links out


def test_report_rejects_unknown_output(result_files, tmp_path):
    assert bench("report", str(result_files["serving"]), "--output",
                 str(tmp_path / "x.pdf")) == 2
