"""Every layout of the tied-head pipeline and 16-bit-master checks against one process (CPU,
gloo): `tests/helpers/tied_pp.py` (fp32 parity of loss, gradient norm and first-step
gradients; the two copies of the tied weight equal; the pipeline's checkpoint resumed in one
process) and `tests/helpers/bf16_masters.py` (parity within bf16 noise; the parameter,
gradient, master and optimizer bytes each rank holds against the planner's). The tests run a
few of these layouts; this runs all of them and writes the tables to
bench/results/pp_tied_bf16_cpu.txt.

Run: python bench/pp_tied_bf16_cpu.py (about 5 minutes on 2 cores; asserts the tolerances).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import bf16_masters, tied_pp  # noqa: E402
from tests.parallel.distributed.test_pp_tied_bf16_masters import run_both  # noqa: E402

HEADER = ("| layout | ranks | loss (rel.) | grad norm (rel.) | first-step grads / validation "
          "(rel.) | |\n|---|---|---|---|---|---|")


def main() -> None:
    rows = []
    for world, tied, bf16 in ((2, tied_pp.LAYOUTS_2, bf16_masters.LAYOUTS_2),
                              (4, tied_pp.LAYOUTS_4, bf16_masters.LAYOUTS_4)):
        with tempfile.TemporaryDirectory() as tmp:
            rows += run_both(Path(tmp), world, tied, bf16)
    text = HEADER + "\n" + "\n".join(rows) + "\n"
    out = ROOT / "bench" / "results" / "pp_tied_bf16_cpu.txt"
    out.write_text(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
