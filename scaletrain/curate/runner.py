"""Run a pipeline over input files with an executor: tasks, outputs, resume and statistics.

`run_pipeline(steps, inputs, output_dir)` plans tasks over the input shards, runs the
per-document steps in each task and writes the kept documents to
`OUTPUT/part-TTTTT-NNNNN.jsonl` (task T, file N). Steps that need the whole corpus before
they can decide (deduplication: `GlobalStep`) split the pipeline into stages: the stage
before one is written to `OUTPUT/_work/stage-K/`, the global step is fitted on it (its own
tasks, then one reduce), and then acts as a per-document filter at the head of the next
stage. Every task has a completion marker under `OUTPUT/_work/`, so running the same command
again after a crash redoes only unfinished tasks and gives the same output. Statistics go to
`OUTPUT/stats.json`; dropped documents, with their reason, to `OUTPUT/_dropped/` if asked.
`OUTPUT/manifest.json`, written last, lists the kept shards: readers of the folder read those
only. A run holds `OUTPUT/.lock` (its workers inherit it and die with the driver), so a second
run in the same folder waits for every process of the first.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.curate.drop_profile import DropProfile, summarize_profiles
from scaletrain.curate.executors import Executor, LocalExecutor
from scaletrain.curate.executors.lifeline import LOCK_NAME, RunLock
from scaletrain.curate.io.manifest import forget_manifest, write_manifest
from scaletrain.curate.io.readers import ReadReport, Shard, plan_shards
from scaletrain.curate.io.writers import make_writer
from scaletrain.curate.pipeline import Pipeline, Step, StepStats, merge_stats
from scaletrain.curate.task_inputs import positioned

log = logging.getLogger(__name__)

WORK_DIR = "_work"
DROPPED_DIR = "_dropped"


class GlobalStep(Step):
    """A step that sees the whole corpus first (`fit`), then drops documents by id."""

    fit_seconds: float = 0.0

    def fit(self, shards: list[Shard], executor: Executor, work_dir: str) -> None:
        raise NotImplementedError


@dataclass
class RunOptions:
    """Where and how: tasks, output format and size, dropped-document output."""

    tasks: int | None = None  # None: about one task per `task_bytes` of input
    task_bytes: int = 32 << 20
    min_tasks: int = 4  # with tasks=None: at least this many (when there are enough shards)
    output_format: str = "jsonl"
    shard_bytes: int = 256 << 20
    write_dropped: bool = False
    keep_work: bool = False  # keep intermediate stages after a successful run
    strict: bool = False  # stop at the first malformed record (`MalformedRecord`)


def group_shards(
    shards: list[Shard], n_tasks: int | None, task_bytes: int, min_tasks: int = 1
) -> list[list[Shard]]:
    """Pack shards, in order, into tasks of about equal input bytes."""
    sizes = [_shard_bytes(s) for s in shards]
    total = sum(sizes)
    if not n_tasks and min_tasks > 1 and total < task_bytes * min_tasks:
        n_tasks = min(min_tasks, len(shards))
    if n_tasks:  # contiguous groups with boundaries at k * total / n_tasks bytes
        groups: list[list[Shard]] = [[] for _ in range(n_tasks)]
        acc = 0
        for s, n in zip(shards, sizes):
            groups[min(n_tasks - 1, acc * n_tasks // max(total, 1))].append(s)
            acc += n
        return [g for g in groups if g]
    groups = [[]]
    acc = 0
    for s, n in zip(shards, sizes):
        if groups[-1] and acc + n > task_bytes:
            groups.append([])
            acc = 0
        groups[-1].append(s)
        acc += n
    return [g for g in groups if g]


def _shard_bytes(s: Shard) -> int:
    if s.end is not None and s.format == "jsonl":
        return s.end - s.start
    try:
        return os.path.getsize(s.path)
    except OSError:
        return 1


def process_task(
    i: int,
    *,
    tasks: list[list[Shard]],
    pipeline: Pipeline,
    out_dir: str,
    opts: RunOptions,
    dropped_dir: str | None,
) -> dict[str, Any]:
    """One task: read its shards, run the steps, write kept (and dropped) documents."""
    report = ReadReport(strict=opts.strict)
    stats = pipeline.new_stats()
    first = sum(len(t) for t in tasks[:i])  # index of this task's first shard in the stage
    read = [0]
    profile = DropProfile(tasks[i])
    writer = make_writer(out_dir, opts.output_format, f"part-{i:05d}", opts.shard_bytes)
    drop_writer = (
        make_writer(dropped_dir, "jsonl", f"dropped-{i:05d}", opts.shard_bytes)
        if dropped_dir
        else None
    )

    dropped_samples: dict[str, list[dict[str, str]]] = {}
    kept_samples: list[dict[str, str]] = []

    def on_drop(step: str, doc: Document, reason: str) -> None:
        if doc.pos is not None:
            profile.drop(int(doc.pos.split(":", 1)[0]) - first, step, reason)
        some = dropped_samples.setdefault(f"{step}: {reason}", [])
        if len(some) < SAMPLES:
            some.append(_sample(doc))
        if drop_writer is not None:
            meta = {**doc.metadata, "dropped_by": step, "drop_reason": reason}
            drop_writer.write(Document(doc.id, doc.text, meta))

    docs = positioned(tasks[i], first, report, read, steps=pipeline.steps, stats=stats,
                      on_drop=on_drop, profile=profile)
    try:
        for doc in pipeline.run(docs, stats, on_drop):
            if len(kept_samples) < SAMPLES:
                kept_samples.append(_sample(doc))
            writer.write(doc)
        n_in = read[0]
        files = writer.close()
        if drop_writer is not None:
            drop_writer.close()
    except BaseException:
        writer.abort()
        if drop_writer is not None:
            drop_writer.abort()
        raise
    return {
        "stats": [s.to_dict() for s in stats],
        "docs_in": n_in,
        "docs_out": writer.count,
        "files": [os.path.basename(f) for f in files],
        "file_documents": writer.file_counts,
        "malformed": report.malformed,
        "malformed_examples": report.examples,
        "skipped": dict(report.skipped),
        "notes": dict(report.notes),
        "samples": {"kept": kept_samples, "dropped": dropped_samples},
        "profile": profile.to_dict(),
    }


SAMPLES = 3  # kept documents, and dropped documents per reason, shown in the report
_SAMPLE_CHARS = 300


def _sample(doc: Document) -> dict[str, str]:
    text = doc.text if len(doc.text) <= _SAMPLE_CHARS else doc.text[:_SAMPLE_CHARS] + "..."
    return {"id": doc.id, "text": text}


def _fingerprint(steps: list[Step], shards: list[Shard], opts: RunOptions, sized: bool) -> str:
    """What a stage's tasks are a function of: its steps, its input shards (with their sizes
    when `sized`: the run's own inputs), the tasking options and the output format.

    Later stages read an earlier stage's files, which a finished run removes; their sizes
    are left out (the earlier stage's fingerprint covers their content), and the task
    grouping made from them is saved with the job instead (`_tasks`)."""
    desc = [s.described() for s in steps] + [repr(sh) for sh in shards]
    if sized:
        desc += [str(_shard_bytes(sh)) for sh in shards]
    desc += [repr((opts.tasks, opts.task_bytes, opts.min_tasks)), opts.output_format]
    return hashlib.sha256("\n".join(desc).encode()).hexdigest()[:16]


def _tasks(job_dir: str, shards: list[Shard], opts: RunOptions) -> list[list[Shard]]:
    """The stage's shards grouped into tasks: as saved by the job's first run, else grouped
    by size now and saved (a re-run must give task i the same shards)."""
    path = os.path.join(job_dir, "tasks.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return [[Shard(**sh) for sh in task] for task in json.load(f)]
    tasks = group_shards(shards, opts.tasks, opts.task_bytes, opts.min_tasks)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump([[dataclasses.asdict(sh) for sh in task] for task in tasks], f)
    os.replace(path + ".tmp", path)
    return tasks


def _prepare_job(job_dir: str, fingerprint: str, out_dir: str) -> None:
    """Reuse a job dir with the same fingerprint; refuse to mix runs of different jobs."""
    os.makedirs(job_dir, exist_ok=True)
    fp_file = os.path.join(job_dir, "fingerprint")
    if os.path.exists(fp_file):
        with open(fp_file) as f:
            if f.read().strip() != fingerprint:
                raise ValueError(
                    f"'{out_dir}' holds a run of a different pipeline or input; "
                    "choose another --output or delete it (or use --overwrite)"
                )
    else:
        with open(fp_file, "w") as f:
            f.write(fingerprint)


def _clean_unfinished(job_dir: str, out_dir: str, n_tasks: int) -> None:
    """Leftovers of tasks killed half-way: temporary files, outputs of unfinished tasks."""
    for tmp in glob.glob(os.path.join(glob.escape(out_dir), "*.tmp")):
        os.remove(tmp)
    done = (
        set(os.listdir(os.path.join(job_dir, "done")))
        if os.path.isdir(os.path.join(job_dir, "done"))
        else set()
    )
    for i in range(n_tasks):
        if f"{i:05d}.json" not in done:
            for f in glob.glob(os.path.join(glob.escape(out_dir), f"part-{i:05d}-*")):
                os.remove(f)


def run_stage(
    steps: list[Step],
    shards: list[Shard],
    out_dir: str,
    job_dir: str,
    executor: Executor,
    opts: RunOptions,
    desc: str,
    dropped_dir: str | None = None,
    sized: bool = True,
) -> list[dict[str, Any]]:
    """Run per-document steps over shards into `out_dir`; returns per-task results.
    `sized`: the shards are the run's inputs (not an earlier stage's files)."""
    pipeline = Pipeline(steps)
    _prepare_job(job_dir, _fingerprint(steps, shards, opts, sized), out_dir)
    tasks = _tasks(job_dir, shards, opts)
    _clean_unfinished(job_dir, out_dir, len(tasks))
    fn = functools.partial(
        process_task,
        tasks=tasks,
        pipeline=pipeline,
        out_dir=out_dir,
        opts=opts,
        dropped_dir=dropped_dir,
    )
    log.info("%s: %d input shards in %d tasks on %s", desc, len(shards), len(tasks), executor.name)
    return executor.run(fn, len(tasks), job_dir, desc)


def output_shards(out_dir: str, results: list[dict[str, Any]]) -> list[Shard]:
    return [Shard(os.path.join(out_dir, f)) for r in results for f in r["files"]]


def split_stages(steps: list[Step]) -> list[list[Step]]:
    """Cut the step list before every global step (a global step heads its stage)."""
    stages: list[list[Step]] = [[]]
    for s in steps:
        if isinstance(s, GlobalStep) and stages[-1]:
            stages.append([])
        stages[-1].append(s)
    return stages


def _check_kinds(stages: list[list[Step]]) -> None:
    """Steps limited to one kind of document (`only`) must read the run's input files: the
    kind comes from the file a document was read from, which later stages do not see."""
    for k, stage in enumerate(stages):
        for s in stage:
            if s.only is None:
                continue
            if isinstance(s, GlobalStep):
                raise ValueError(f"step '{s.name}': only = \"{s.only}\" is not supported on "
                                 "a deduplication step; it sees every document")
            if k > 0:
                raise ValueError(f"step '{s.name}' (only = \"{s.only}\") comes after a "
                                 "deduplication step; put the steps limited to one kind "
                                 "before the first deduplication step")


def run_pipeline(
    steps: list[Step],
    inputs: str | list[str],
    output_dir: str,
    executor: Executor | None = None,
    opts: RunOptions | None = None,
    overwrite: bool = False,
    root: str | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline; returns (and writes to OUTPUT/stats.json) the run summary.

    `root`: the directory text-file ids are relative to (default: each input's directory).
    """
    os.makedirs(output_dir, exist_ok=True)
    with RunLock(output_dir):  # one run per folder; waits for a killed run's processes
        return _run_pipeline(steps, inputs, output_dir, executor, opts, overwrite, root)


def _run_pipeline(
    steps: list[Step],
    inputs: str | list[str],
    output_dir: str,
    executor: Executor | None,
    opts: RunOptions | None,
    overwrite: bool,
    root: str | None,
) -> dict[str, Any]:
    executor = executor or LocalExecutor()
    opts = opts or RunOptions()
    if overwrite:
        for name in os.listdir(output_dir):
            if name != LOCK_NAME:
                p = os.path.join(output_dir, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    forget_manifest(output_dir)
    t0 = time.perf_counter()
    shards = plan_shards(inputs, target_bytes=opts.task_bytes, root=root)
    input_bytes = sum(_shard_bytes(s) for s in shards)
    Pipeline(steps)  # give repeated step names their suffixes before fingerprints are taken
    stages = split_stages(steps)
    _check_kinds(stages)
    work = os.path.join(output_dir, WORK_DIR)
    dropped_dir = os.path.join(output_dir, DROPPED_DIR) if opts.write_dropped else None
    all_results: list[list[dict[str, Any]]] = []
    for k, stage in enumerate(stages):
        head = stage[0]
        if isinstance(head, GlobalStep):
            t_fit = time.perf_counter()
            head.fit(shards, executor, os.path.join(work, f"fit-{k}-{head.name}"))
            head.fit_seconds = time.perf_counter() - t_fit
        last = k == len(stages) - 1
        out_dir = output_dir if last else os.path.join(work, f"stage-{k}")
        stage_dropped = os.path.join(dropped_dir, f"stage-{k}") if dropped_dir else None
        results = run_stage(
            stage,
            shards,
            out_dir,
            os.path.join(work, f"job-{k}"),
            executor,
            opts if last else RunOptions(opts.tasks, opts.task_bytes, opts.min_tasks,
                                         strict=opts.strict),
            f"stage {k + 1}/{len(stages)}",
            stage_dropped,
            sized=k == 0,
        )
        all_results.append(results)
        shards = output_shards(out_dir, results)
    summary = summarize(steps, all_results, executor, time.perf_counter() - t0, input_bytes)
    summary["output_files"] = [s.path for s in shards]
    tmp = os.path.join(output_dir, "stats.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(output_dir, "stats.json"))
    if not opts.keep_work:
        for k in range(len(stages) - 1):
            shutil.rmtree(os.path.join(work, f"stage-{k}"), ignore_errors=True)
    kept = [
        (os.path.join(output_dir, f), n)
        for r in all_results[-1]
        for f, n in zip(r["files"], r.get("file_documents", [None] * len(r["files"])))
    ]
    write_manifest(output_dir, kept, {"output_format": opts.output_format})  # last: run done
    return summary


def summarize(
    steps: list[Step],
    stage_results: list[list[dict[str, Any]]],
    executor: Executor,
    seconds: float,
    input_bytes: int,
) -> dict[str, Any]:
    """Statistics of a run: per step (all tasks added up), read errors, totals."""
    step_stats: list[StepStats] = []
    malformed, examples = 0, []
    skipped: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    for results in stage_results:
        merged = merge_stats([StepStats.from_dict(d) for d in r["stats"]] for r in results)
        step_stats += merged
        for r in results:
            malformed += r["malformed"]
            examples += r["malformed_examples"]
            skipped.update(r.get("skipped", {}))
            notes.update(r.get("notes", {}))
    descr = {s.name: s.described() for s in steps}
    fits = {s.name: s for s in steps if isinstance(s, GlobalStep)}
    first, last = stage_results[0], stage_results[-1]
    stages = [
        {"stage": k + 1, "tasks": len(results), "steps": [s.name for s in stage]}
        for k, (stage, results) in enumerate(zip(split_stages(steps), stage_results))
    ]
    docs_in = sum(r["docs_in"] for r in first)
    by_kind, hints = summarize_profiles([r.get("profile") or {} for r in first])
    docs_out = sum(r["docs_out"] for r in last)
    dropped = sum(sum(s.dropped.values()) for s in step_stats)
    return {
        "executor": executor.name,
        "seconds": round(seconds, 3),
        "input_bytes": input_bytes,
        # every input record once: kept + dropped + malformed + skipped = input_records
        "input_records": docs_in + malformed + sum(skipped.values()),
        "kept": docs_out,
        "dropped": dropped,
        "malformed": malformed,
        "skipped": sum(skipped.values()),
        "skipped_reasons": dict(sorted(skipped.items())),
        "notes": dict(sorted(notes.items())),
        "docs_in": docs_in,
        "docs_out": docs_out,
        "tasks": sum(st["tasks"] for st in stages),
        "stages": stages,
        "samples": _merge_samples(stage_results),
        "malformed_records": malformed,
        "malformed_examples": examples[:20],
        # the first stage's drops per kind of input file, and folders one rule drops most of
        "by_kind": by_kind,
        "hints": hints,
        "steps": [_step_entry(s, descr.get(s.name, s.name), fits.get(s.name)) for s in step_stats],
    }


def _merge_samples(stage_results: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A few kept documents (of the output) and a few dropped ones per step and reason."""
    kept: list[dict[str, str]] = []
    dropped: dict[str, list[dict[str, str]]] = {}
    for results in stage_results:
        for r in results:
            samples = r.get("samples", {})
            for key, docs in samples.get("dropped", {}).items():
                dropped.setdefault(key, []).extend(docs)
    for r in stage_results[-1]:
        kept += r.get("samples", {}).get("kept", [])
    return {"kept": kept[:SAMPLES], "dropped": {k: v[:SAMPLES] for k, v in sorted(dropped.items())}}


def _step_entry(s: StepStats, settings: str, fitted: GlobalStep | None) -> dict[str, Any]:
    """A step's statistics; a global step's fit (map tasks + reduce, wall time) is added to
    its seconds and reported on its own as well."""
    d = {**s.to_dict(), "settings": settings}
    if fitted is not None:
        d["fit_seconds"] = round(fitted.fit_seconds, 4)
        d["seconds"] = round(d["seconds"] + fitted.fit_seconds, 4)
        d["fit"] = getattr(fitted, "fit_stats", {})
    return d
