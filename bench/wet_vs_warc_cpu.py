"""Documents per second reading Common Crawl WET files against WARC files, on one core.

    python bench/wet_vs_warc_cpu.py              # the fixtures' pages, 5 repeats
    python bench/wet_vs_warc_cpu.py --repeats 20

Input: the two WARC fixtures of shared/fixtures/data (37 HTML pages) and a WET file of the
same pages (one `conversion` record per page, holding the text the WARC reader extracts, as
Common Crawl's WET files hold its own extraction; tests/helpers/wet.py), plus a WARC gzipped
as one stream. Each is read with `read_documents` (WARC: trafilatura's extraction per page;
WET: the text as it is), and then run through the web rules (language, Gopher, C4, FineWeb)
in one process: documents/s of reading alone and of reading + rules. Best of `--repeats`.
Results: a table, and the same in bench/results/wet_vs_warc_cpu.txt.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scaletrain.curate.io.readers import ReadReport, read_documents  # noqa: E402
from scaletrain.curate.pipeline import Pipeline  # noqa: E402
from scaletrain.curate.registry import DEFAULT_MIXED_PIPELINE, build_step  # noqa: E402
from tests.helpers.wet import fixture_pages, write_wet  # noqa: E402


def _fixtures() -> Path:
    for c in (os.environ.get("SCALETRAIN_FIXTURES", ""), str(ROOT.parent / "shared" / "fixtures"),
              "/work/shared/fixtures"):
        if c and (Path(c) / "data" / "README.md").exists():
            return Path(c) / "data"
    sys.exit("shared/fixtures/data not found (set SCALETRAIN_FIXTURES)")


def _web_rules() -> Pipeline:
    steps = [build_step({k: v for k, v in s.items() if k != "only"})
             for s in DEFAULT_MIXED_PIPELINE if s.get("only") == "web"]
    return Pipeline(steps)


def _measure(paths: list[str], repeats: int) -> dict[str, float]:
    best_read, best_all, docs, kept = float("inf"), float("inf"), 0, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        read = list(read_documents(paths, ReadReport()))
        t1 = time.perf_counter()
        pipe = _web_rules()
        out = list(pipe.run(read, pipe.new_stats()))
        t2 = time.perf_counter()
        best_read, best_all = min(best_read, t1 - t0), min(best_all, t2 - t0)
        docs, kept = len(read), len(out)
    return {"docs": docs, "kept": kept, "read_s": best_read, "all_s": best_all}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    warcs = sorted(_fixtures().glob("*.warc.gz"))
    with tempfile.TemporaryDirectory() as tmp:
        wet = write_wet(Path(tmp) / "CC-MAIN-fixtures.warc.wet.gz", fixture_pages(warcs))
        whole = Path(tmp) / "onestream.warc.gz"
        whole.write_bytes(gzip.compress(b"".join(gzip.decompress(w.read_bytes()) for w in warcs)))
        inputs = {"WARC (.warc.gz, per-record gzip)": [str(w) for w in warcs],
                  "WARC (one gzip stream)": [str(whole)],
                  "WET (.warc.wet.gz)": [str(wet)]}
        rows = {name: _measure(paths, args.repeats) for name, paths in inputs.items()}
    lines = [f"# python bench/wet_vs_warc_cpu.py --repeats {args.repeats}  "
             f"({platform.python_version()}, {platform.machine()}, one process, best of "
             f"{args.repeats})",
             f"{'input':<34} {'docs':>5} {'kept':>5} {'read docs/s':>12} {'read+rules docs/s':>18}"]
    for name, r in rows.items():
        lines.append(f"{name:<34} {r['docs']:>5} {r['kept']:>5} {r['docs'] / r['read_s']:>12,.0f}"
                     f" {r['docs'] / r['all_s']:>18,.0f}")
    warc, wet_r = rows["WARC (.warc.gz, per-record gzip)"], rows["WET (.warc.wet.gz)"]
    lines.append(f"WET reads {warc['read_s'] / wet_r['read_s']:.0f}x faster than WARC "
                 f"(read + web rules: {warc['all_s'] / wet_r['all_s']:.1f}x)")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench" / "results" / "wet_vs_warc_cpu.txt"
    out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
