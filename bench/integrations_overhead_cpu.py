"""The profiler's overhead on the Hugging Face Trainer's step (CPU), inside and outside the
window of `scaletrain.integrations.hf.ScaletrainCallback`.

Two runs of the same Trainer on the same data and seed: without the callback, and with it
(window after `--start` steps: wait 1, warmup 1, active 3). A step's time runs from one
`on_step_begin` to the next, so it includes every callback of that step (the trace export and
the diagnosis at the window's end are charged to the step that closes it). Both the process's
CPU time (all its threads: what the profiler adds is CPU work, and CPU time is what a machine
shared with other jobs does not inflate) and the wall time are taken. The table gives the
median by phase of the window and its ratio to the same steps of the run without the
callback; the runs alternate `--repeats` times. One intra-op thread.

    python bench/integrations_overhead_cpu.py [--steps 18] [--start 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from scaletrain.integrations.hf import ScaletrainCallback  # noqa: E402

SEQ, MBS, VOCAB = 128, 2, 2048


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.begins: list[tuple[float, float]] = []  # (process CPU time, wall time)

    def on_step_begin(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.begins.append((time.process_time(), time.perf_counter()))

    def on_train_end(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.begins.append((time.process_time(), time.perf_counter()))

    def step_times(self) -> list[tuple[float, float]]:
        return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.begins, self.begins[1:])]


def run(steps: int, callback: TrainerCallback | None, out: Path) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x}
            for x in torch.randint(0, VOCAB, (steps * MBS, SEQ), generator=g)]
    clock = StepClock()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=MBS,
                             max_steps=steps, report_to="none", logging_steps=10**6,
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    callbacks = [clock] + ([callback] if callback else [])
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return clock.step_times()


def phases(steps: int, start: int, wait: int = 1, warmup: int = 1,
           active: int = 3) -> list[str]:
    """The window phase of each step (1-based, as the Trainer counts them)."""
    names = []
    for s in range(1, steps + 1):
        k = s - start  # steps since the profiler started (it starts after step `start`)
        if k <= 0:
            names.append("before window")
        elif k <= wait:
            names.append("wait (profiler on, idle)")
        elif k <= wait + warmup:
            names.append("warmup (tracing)")
        elif k < wait + warmup + active:
            names.append("active (tracing)")
        elif k == wait + warmup + active:
            names.append("last active + export + diagnose")
        else:
            names.append("after window")
    return names


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--start", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    base: list[list[tuple[float, float]]] = []
    prof: list[list[tuple[float, float]]] = []
    with TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            base.append(run(a.steps, None, Path(tmp) / f"base{r}"))
            prof.append(run(a.steps, ScaletrainCallback(start_step=a.start, report=None),
                            Path(tmp) / f"prof{r}"))
    names = phases(a.steps, a.start)
    print(f"HF Trainer step on CPU (1 intra-op thread; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores at the end): Llama 256 x 2 layers, vocab {VOCAB}, batch "
          f"{MBS} x {SEQ}, fp32; {a.steps} steps, window after step {a.start} (wait 1, warmup "
          f"1, active 3), {a.repeats} alternating runs each; step 1 (warm-up) left out; "
          "medians")
    print(f"{'phase':<34}{'steps':>6}{'CPU ms without':>16}{'with':>8}{'ratio':>7}"
          f"{'wall ms without':>17}{'with':>8}{'ratio':>7}")
    for phase in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == phase and i > 0]
        if not idx:
            continue
        row = f"{phase:<34}{len(idx):>6}"
        for k, width in ((0, 16), (1, 17)):
            b = statistics.median(t[i][k] for t in base for i in idx) * 1e3
            w = statistics.median(t[i][k] for t in prof for i in idx) * 1e3
            row += f"{b:>{width}.1f}{w:>8.1f}{w / b:>7.2f}"
        print(row)


if __name__ == "__main__":
    main()
