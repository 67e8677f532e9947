"""The profiler's overhead on the Hugging Face Trainer's step (CPU), inside and outside the
window of `scaletrain.integrations.hf.ScaletrainCallback`.

Two runs of the same Trainer on the same data and seed: without the callback, and with it
(window after `--start` steps: wait 1, warmup 1, active 3). A step's time is the wall time
from one `on_step_begin` to the next, so it includes every callback of that step (the trace
export and the diagnosis at the window's end are charged to the step that closes it). The
table gives the median step time by phase of the window and its ratio to the same steps of
the run without the callback; the runs alternate `--repeats` times (the machine's load
drifts).

    python bench/integrations_overhead_cpu.py [--steps 24] [--start 8] [--repeats 2]
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

SEQ, MBS, VOCAB = 128, 4, 2048


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.begins: list[float] = []

    def on_step_begin(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.begins.append(time.perf_counter())

    def on_train_end(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.begins.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.begins, self.begins[1:])]


def run(steps: int, callback: TrainerCallback | None, out: Path) -> list[float]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
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
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--start", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    base: list[list[float]] = []
    prof: list[list[float]] = []
    with TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            base.append(run(a.steps, None, Path(tmp) / f"base{r}"))
            prof.append(run(a.steps, ScaletrainCallback(start_step=a.start, report=None),
                            Path(tmp) / f"prof{r}"))
    names = phases(a.steps, a.start)
    print(f"HF Trainer step on CPU ({torch.get_num_threads()} threads; load average "
          f"{os.getloadavg()[0]:.1f}): Llama 256x4 layers, vocab {VOCAB}, batch {MBS}x{SEQ}, "
          f"fp32; {a.steps} steps, window after step {a.start} (wait 1, warmup 1, active 3), "
          f"{a.repeats} alternating runs each; step 1 (warm-up) left out")
    print(f"{'phase':<34}{'steps':>6}{'without ms':>12}{'with ms':>10}{'ratio':>8}")
    for phase in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == phase and i > 0]
        if not idx:
            continue
        b = statistics.median(t[i] for t in base for i in idx) * 1e3
        w = statistics.median(t[i] for t in prof for i in idx) * 1e3
        print(f"{phase:<34}{len(idx):>6}{b:>12.1f}{w:>10.1f}{w / b:>8.2f}")


if __name__ == "__main__":
    main()
