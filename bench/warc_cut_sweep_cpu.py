"""Cut a real Common Crawl WARC at many byte positions and read each cut file: every cut must
read without an exception, give a prefix of the whole file's documents, and count every
record begun before the cut once (document, skipped or malformed; the one cut short is the
malformed one).

    python bench/warc_cut_sweep_cpu.py                        # every 7th byte, .warc.gz
    python bench/warc_cut_sweep_cpu.py --stride 1 --plain     # every byte of the .warc

Main-text extraction is replaced by the page's bytes (the reader is under test, not
trafilatura). Prints the counts and the failures by kind; writes JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
FIXTURES = Path(os.environ.get("SCALETRAIN_FIXTURES", ROOT.parent / "shared" / "fixtures"))
if not (FIXTURES / "data").is_dir():
    FIXTURES = Path("/work/shared/fixtures")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=str(FIXTURES / "data" / "cc_sample-0000.warc.gz"))
    ap.add_argument("--stride", type=int, default=7)
    ap.add_argument("--plain", action="store_true", help="sweep the decompressed .warc")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "warc_cut_sweep_cpu.json"))
    args = ap.parse_args()
    from warcio.archiveiterator import ArchiveIterator

    import scaletrain.curate.io.warc as warc_mod
    from scaletrain.curate.io.readers import ReadReport, Shard, read_shard

    warc_mod.extract_html = lambda html, url=None: (
        html.decode("utf-8", "replace") if isinstance(html, bytes) else html) or None
    blob = Path(args.file).read_bytes()
    if args.plain:
        blob = gzip.decompress(blob)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("cut.warc" if args.plain else "cut.warc.gz")
        path.write_bytes(blob)
        spans = []
        with open(path, "rb") as f:
            it = ArchiveIterator(f)
            for r in it:
                r.content_stream().read()
                spans.append((it.get_record_offset(), it.get_record_length()))
        whole = [d.text for d in read_shard(Shard(str(path)))]
        failures: Counter[str] = Counter()
        first: dict[str, int] = {}
        malformed_cuts = 0
        cuts = list(range(len(blob), -1, -args.stride))
        logging.disable(logging.WARNING)
        t0 = time.perf_counter()
        for cut in cuts:  # longest first: shrinking a file is cheap
            os.truncate(path, cut)
            report = ReadReport()
            try:
                docs = [d.text for d in read_shard(Shard(str(path)), report)]
            except Exception as e:  # noqa: BLE001 - what the sweep looks for
                kind = f"exception {type(e).__name__}"
            else:
                started = sum(1 for s, _ in spans if s < cut and blob[s:cut].strip())
                complete = sum(1 for s, n in spans if s + n <= cut)
                got = len(docs) + report.skipped_total + report.malformed
                kind = ("not a prefix of the whole file's documents" if docs != whole[:len(docs)]
                        else f"counted {got} of {started} records" if got != started
                        else "malformed count wrong" if report.malformed != started - complete
                        else "")
                malformed_cuts += bool(report.malformed)
            if kind:
                failures[kind] += 1
                first.setdefault(kind, cut)
        dt = time.perf_counter() - t0
    body = {"file": args.file, "plain": args.plain, "bytes": len(blob), "records": len(spans),
            "documents": len(whole), "stride": args.stride, "cuts": len(cuts),
            "cuts_with_a_malformed_record": malformed_cuts, "failures": dict(failures),
            "first_failing_cut": first, "seconds": round(dt, 1)}
    print(json.dumps(body, indent=1))
    Path(args.out).write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
