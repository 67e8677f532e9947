"""`scaletrain tune` on CPU ranks: the tuning table and the rank correlation between the
search's predicted step times and the measured ones, for the debug model and a ~100M-parameter
Llama (the debug preset widened: dim 768, 14 layers, 12 heads, 4 KV heads, FFN 2048).

    python bench/tune_cpu.py                                  # both models, 4 ranks
    python bench/tune_cpu.py --models debug --nproc 4 --budget-minutes 5

Each model runs the CLI itself (`python -m scaletrain tune ...`) into a temporary folder; its
terminal output goes to bench/results/tune_cpu_<model>.txt and its tune.json to
bench/results/tune_cpu_<model>.json. Timings depend on the machine and its load: on a shared
host the same trial varies by tens of percent between runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODELS = {
    "debug": ["--model.name", "debug", "--data.seq_len", "128",
              "--training.micro_batch_size", "2"],
    "100m": ["--model.name", "debug", "--model.dim", "768", "--model.n_layers", "14",
             "--model.n_heads", "12", "--model.n_kv_heads", "4", "--model.ffn_dim", "2048",
             "--data.seq_len", "128", "--training.micro_batch_size", "1"],
}
BUDGET_MIN = {"debug": 6.0, "100m": 14.0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="debug,100m")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="per model (default: 6 for debug, 14 for 100m)")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        budget = a.budget_minutes or BUDGET_MIN[name]
        with tempfile.TemporaryDirectory(prefix=f"tune-{name}-") as tmp:
            cmd = [sys.executable, "-m", "scaletrain", "tune", "--nproc", str(a.nproc),
                   "--budget-minutes", str(budget), *MODELS[name], "--output", tmp]
            start = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            wall = time.monotonic() - start
            cpu = platform.processor() or platform.machine()
            shown = " ".join(cmd[1:]).replace(tmp, "OUT")
            load = os.getloadavg()[0]  # other jobs on a shared host move every figure
            head = (f"# {shown}\n# {cpu}, {os.cpu_count()} cores, load average {load:.1f} at "
                    f"the end; exit {r.returncode}, {wall:.0f} s wall\n")
            log = [ln for ln in r.stderr.splitlines() if ln.startswith(("tuning", "trial"))]
            text = head + "\n".join(log) + "\n\n" + r.stdout.replace(tmp, "OUT")
            (a.out / f"tune_cpu_{name}.txt").write_text(text)
            src = Path(tmp) / "tune" / "tune.json"
            if src.exists():
                shutil.copy(src, a.out / f"tune_cpu_{name}.json")
            print(text)


if __name__ == "__main__":
    main()
