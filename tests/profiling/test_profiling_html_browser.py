"""The HTML report rendered by a real headless browser (Debian's `chromium`): the plots draw.
Skips when chromium or plotly is not installed (`apt-get install chromium`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scaletrain.commands import diagnose
from tests.helpers.proc import scaled
from tests.helpers.profiling_traces import gpu_trace

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium for a headless screenshot")

COMPUTE_GREEN = (0x2E, 0x7D, 0x32)  # html_report.COLORS["compute"]
COMM_BLUE = (0x15, 0x65, 0xC0)


def screenshot(page: Path, png: Path, height: int = 2400) -> Path:
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1200,{height}", "--virtual-time-budget=5000",
                    f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=scaled(120))
    return png


def test_plots_render_in_a_headless_browser(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    image = pytest.importorskip("PIL.Image")
    traces = [gpu_trace([("compute", 3000), ("exposed_comm", 500 + 2000 * (i == 0))],
                        rank=i, world=2) for i in range(2)]
    paths = [t.write(tmp_path / f"rank{i}.json.gz") for i, t in enumerate(traces)]
    page = tmp_path / "report.html"
    assert diagnose.main([*map(str, paths), "--html", str(page)]) == 0
    png = screenshot(page, tmp_path / "report.png")
    colors = {c for _, c in image.open(png).convert("RGB").getcolors(maxcolors=1 << 20)}
    # the bars are drawn by plotly.js in the browser: without the script the page has no color
    assert COMPUTE_GREEN in colors and COMM_BLUE in colors
