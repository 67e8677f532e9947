"""The resumable generate -> critique -> filter loop of `scaletrain data synth`.

The prompt list is split into `tasks` contiguous slices. A task (in this process, on local
worker processes or on Ray, through the curation executors) generates, critiques and applies
the per-candidate filters (threshold, curation steps, decontamination, dedup against the
corpus) and appends its records, one round of `chunk_prompts` prompts at a time, fsynced, to
OUT/tasks/task-NNNNN.jsonl. Then one merge pass in prompt order applies MinHash dedup within
the run and writes:
  candidates.jsonl  one record per candidate (prompt, candidate, critique, score, kept, reason)
  kept.jsonl        the kept candidates as documents (score etc. in the metadata)
  stats.json, report.html   monitoring, computed from the records
all under temporary names, renamed when complete.

Resume: a task log is its own completion marker. On start it is read back; a prompt is done
when all its `candidates` records are there. A torn tail (a crash in the middle of a write) is
cut off, so its prompts are generated again; done prompts are never generated again. The merge
is recomputed from the logs, so the result equals that of an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scaletrain.curate.documents import Document
from scaletrain.inference.generators import (
    BudgetExhausted,
    Generator,
    LocalGenerator,
    SamplingParams,
)
from scaletrain.synth.config import SynthConfig
from scaletrain.synth.critique import ClassifierCritic, Critic, JudgeCritic
from scaletrain.synth.filters import Decontaminator, MinHashIndex
from scaletrain.synth.http_client import HTTPGenerator
from scaletrain.synth.monitor import html_summary, summarize, terminal_summary
from scaletrain.synth.prompts import PromptTask, build_prompts, read_values

logger = logging.getLogger(__name__)
LOG_NAME, KEPT_NAME, STATS_NAME, REPORT_NAME = ("candidates.jsonl", "kept.jsonl", "stats.json",
                                                "report.html")


def task_log(out: Path, i: int) -> Path:
    return out / "tasks" / f"task-{i:05d}.jsonl"


def task_slice(tasks: list[PromptTask], i: int, n_tasks: int) -> list[PromptTask]:
    per = -(-len(tasks) // n_tasks)
    return tasks[i * per : (i + 1) * per]


def make_generator(checkpoint: str, url: str, g: Any) -> Generator:
    if url:
        return HTTPGenerator(url, model=g.model, chat=g.chat,
                             concurrency=getattr(g, "concurrency", 4),
                             timeout_s=getattr(g, "timeout_s", 120.0),
                             max_retries=getattr(g, "max_retries", 4),
                             max_requests=getattr(g, "max_requests", 0))
    return LocalGenerator.from_checkpoint(checkpoint, device=getattr(g, "device", "cpu"),
                                          batch_size=getattr(g, "batch_size", 16),
                                          token_budget=getattr(g, "token_budget", 0),
                                          chat=bool(getattr(g, "chat", False)))


def make_critic(cfg: SynthConfig, generator: Generator) -> Critic | None:
    j = cfg.judge
    if j.kind == "none":
        return None
    if j.kind == "classifier":
        return ClassifierCritic(j.classifier, label=j.label or None)
    judge_gen = generator if not (j.checkpoint or j.url) else make_generator(j.checkpoint,
                                                                             j.url, j)
    kwargs: dict[str, Any] = {"rubric": j.rubric} if j.rubric else {}
    return JudgeCritic(judge_gen, lo=j.scale_min, hi=j.scale_max,
                       max_new_tokens=j.max_new_tokens, **kwargs)


def candidate_seed(seed: int, prompt_id: str, k: int) -> int:
    return zlib.crc32(f"{seed}:{prompt_id}:{k}".encode())


def make_tasks(cfg: SynthConfig) -> list[PromptTask]:
    p = cfg.prompts
    slots = {k: list(v) for k, v in p.slots.items()}
    for name, path in p.slot_files.items():
        slots[name] = read_values(path)
    examples = read_values(p.fewshot_file) if p.fewshot_file else None
    return build_prompts(p.template, slots, p.num_prompts, p.seed, examples, p.fewshot_k)


def read_log(path: Path, tasks: dict[str, PromptTask], n: int) -> list[dict[str, Any]]:
    """Records of completed prompts; a torn or incomplete tail is truncated from the file."""
    if not path.exists():
        return []
    records: list[dict[str, Any]] = []
    group: list[dict[str, Any]] = []
    good_end = pos = 0
    with open(path, "rb") as f:
        for raw in f:
            pos += len(raw)
            try:
                rec = json.loads(raw) if raw.endswith(b"\n") else None
            except json.JSONDecodeError:
                rec = None
            if rec is None:
                break
            pid = rec.get("prompt_id")
            if pid not in tasks or tasks[pid].fingerprint() != rec.get("prompt_sha"):
                raise ValueError(f"{path}: record for prompt {pid} does not match this config "
                                 "(template, seed data or seed changed); resume with the same "
                                 "config or write to a new output directory")
            if group and group[0]["prompt_id"] != pid:
                break  # an unfinished group followed by another one: cut here
            group.append(rec)
            if len(group) == n:
                records += group
                group = []
                good_end = pos
    size = path.stat().st_size
    if good_end < size:
        logger.warning("%s: cutting %d bytes of unfinished records at the end (a crash during "
                       "a write); their prompts are generated again", path, size - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return records


class CandidateWorker:
    """Generation, critique and the per-candidate filters for one slice of the prompts."""

    def __init__(self, cfg: SynthConfig, generator: Generator | None = None,
                 critic: Critic | None | str = "auto"):
        self.cfg = cfg
        g = cfg.generator
        self.generator = generator or make_generator(g.checkpoint, g.url, g)
        self.critic = make_critic(cfg, self.generator) if critic == "auto" else critic
        self.params = SamplingParams(g.max_new_tokens, g.temperature, g.top_p or None,
                                     g.top_k or None, list(g.stop))
        self.params.validate()
        f = cfg.filters
        from scaletrain.curate.registry import build_step

        self.steps = [build_step(spec) for spec in f.curation]
        for s in self.steps:
            if hasattr(s, "fit"):
                raise ValueError(f"filters.curation: '{s.name}' needs a whole-corpus pass; use "
                                 "filters.dedup / dedup_corpus for deduplication here")
        self.corpus = None
        if f.dedup_corpus:
            from scaletrain.curate.io.readers import read_documents

            self.corpus = new_index(cfg)
            n = self.corpus.add_texts((f"corpus:{d.id}", d.text)
                                      for d in read_documents(list(f.dedup_corpus)))
            logger.info("dedup: indexed %d corpus documents", n)
        self.decontam = None
        if f.decontaminate:
            texts = [t for path in f.decontaminate for t in read_values(path)]
            self.decontam = Decontaminator(texts, f.decontam_ngram)

    def _decide(self, rec: dict[str, Any]) -> None:
        """Set rec['kept'], rec['reason'] (and maybe rewrite the candidate) in filter order."""
        f = self.cfg.filters
        rec["kept"], rec["reason"] = False, None
        text = rec["candidate"]
        if len(text.strip()) < f.min_chars:
            rec["reason"] = "too_short"
            return
        if self.critic is not None and rec["score"] is None and f.drop_unparsable:
            rec["reason"] = "critique_unparsable"
            return
        if f.min_score is not None and rec["score"] is not None and rec["score"] < f.min_score:
            rec["reason"] = "below_threshold"
            return
        doc = Document(rec["id"], text, {})
        for step in self.steps:
            res = step.process(doc)
            if isinstance(res, str):
                rec["reason"] = f"{step.name}:{res}"
                return
            doc = res
        rec["candidate"] = doc.text
        if self.decontam is not None and (gram := self.decontam.match(doc.text)):
            rec["reason"], rec["detail"] = "contaminated", gram
            return
        if self.corpus is not None:
            hit = self.corpus.query(self.corpus.signatures([doc.text])[0])
            if hit is not None:
                rec["reason"], rec["detail"] = "duplicate_of_corpus", f"{hit[0]} ~{hit[1]:.2f}"
                return
        rec["kept"] = True

    def _chunk(self, tasks: list[PromptTask]) -> list[dict[str, Any]]:
        n = self.cfg.prompts.candidates
        flat = [(t, k) for t in tasks for k in range(n)]
        seeds = [candidate_seed(self.cfg.prompts.seed, t.id, k) for t, k in flat]
        comps = self.generator.complete([t.prompt for t, _ in flat], self.params, seeds)
        crits = self.critic.critique([t.prompt for t, _ in flat], [c.text for c in comps]) \
            if self.critic is not None else [None] * len(flat)
        records = []
        for (t, k), comp, crit in zip(flat, comps, crits):
            rec = {"id": f"{t.id}-c{k}", "prompt_id": t.id, "candidate_index": k,
                   "prompt_sha": t.fingerprint(), "prompt": t.prompt, "slots": t.slots,
                   "candidate": comp.text, "tokens": comp.tokens,
                   "finish_reason": comp.finish_reason,
                   "critique": crit.text if crit else None,
                   "score": crit.score if crit else None}
            self._decide(rec)
            records.append(rec)
        return records

    def run_slice(self, tasks: list[PromptTask], log_path: Path) -> dict[str, Any]:
        """Generate what `log_path` does not hold yet; returns this session's counters."""
        cfg = self.cfg
        log_path.parent.mkdir(parents=True, exist_ok=True)
        records = read_log(log_path, {t.id: t for t in tasks}, cfg.prompts.candidates)
        done = {r["prompt_id"] for r in records}
        todo = [t for t in tasks if t.id not in done]
        if done:
            logger.info("%s: resuming, %d of %d prompts already done", log_path.name, len(done),
                        len(tasks))
        t0, made, complete = time.perf_counter(), 0, True
        with open(log_path, "a", encoding="utf-8") as log:
            for c in range(0, len(todo), cfg.chunk_prompts):
                try:
                    new = self._chunk(todo[c : c + cfg.chunk_prompts])
                except BudgetExhausted as e:
                    logger.warning("stopping: %s; re-run to continue where it stopped", e)
                    complete = False
                    break
                log.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
                log.flush()
                os.fsync(log.fileno())
                made += len(new)
                logger.info("%s: prompts %d/%d, %.2f candidates/s", log_path.name,
                            len(done) + c + len(new) // cfg.prompts.candidates, len(tasks),
                            made / (time.perf_counter() - t0))
        g = self.generator
        return {"complete": complete, "candidates": made,
                "seconds": round(time.perf_counter() - t0, 3),
                "tokens_generated": getattr(g, "tokens_generated", None),
                "http_requests": getattr(g, "requests_sent", None),
                "http_retries": getattr(g, "retries", None)}


def new_index(cfg: SynthConfig) -> MinHashIndex:
    f = cfg.filters
    return MinHashIndex(f.dedup_threshold, shingle=f.dedup_shingle, ngram=f.dedup_ngram)


class SynthTask:
    """Task `i` of `n_tasks` for an executor (picklable: it carries only the config)."""

    def __init__(self, cfg: SynthConfig, n_tasks: int):
        self.cfg, self.n_tasks = cfg, n_tasks

    def __call__(self, i: int) -> dict[str, Any]:
        tasks = task_slice(make_tasks(self.cfg), i, self.n_tasks)
        result = CandidateWorker(self.cfg).run_slice(tasks, task_log(Path(self.cfg.output), i))
        if not result["complete"]:  # no completion marker: the task must run again
            raise BudgetExhausted(f"task {i}: budget spent; re-run to continue")
        return result


class SynthRunner:
    """`run()`: every task (resuming), then the merge; returns the summary.

    `generator` / `critic` may be given for the single-task, in-process case (tests, notebooks).
    """

    def __init__(self, cfg: SynthConfig, generator: Generator | None = None,
                 critic: Critic | None | str = "auto"):
        self.cfg, self.generator, self.critic = cfg, generator, critic
        if cfg.tasks > 1 and (generator is not None or critic != "auto"):
            raise ValueError("a generator or critic object works only with tasks = 1")

    def _check_models(self) -> None:
        """Refuse a local model whose manifest its stored tensor shapes do not bear out
        (`inference.loader.model_args_of`), before the output directory is written."""
        from scaletrain.inference.loader import model_args_of

        cfg = self.cfg
        if self.generator is None and cfg.generator.checkpoint:
            model_args_of(cfg.generator.checkpoint)
        if self.critic == "auto" and cfg.judge.kind == "llm" and cfg.judge.checkpoint:
            model_args_of(cfg.judge.checkpoint)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._check_models()
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        tasks = make_tasks(cfg)
        n_tasks = max(1, min(cfg.tasks, len(tasks)))
        t0 = time.perf_counter()
        if n_tasks == 1:
            worker = CandidateWorker(cfg, self.generator, self.critic)
            self.worker = worker
            results = [worker.run_slice(tasks, task_log(out, 0))]
        else:
            from scaletrain.curate.executors import LocalExecutor, make_executor

            if cfg.executor == "local":  # spawn: torch's thread pools do not survive a fork
                executor = LocalExecutor(cfg.workers or None, start_method="spawn")
            else:
                executor = make_executor(cfg.executor, cfg.workers or None,
                                         cfg.ray_address or None)
            results = executor.run(SynthTask(cfg, n_tasks), n_tasks, str(out / "tasks"),
                                   desc="synth")
        by_id = {t.id: t for t in tasks}
        records = [r for i in range(n_tasks)
                   for r in read_log(task_log(out, i), by_id, cfg.prompts.candidates)]
        self._dedup_run(records)
        session = {"candidates": sum(r.get("candidates", 0) for r in results),
                   "seconds": round(time.perf_counter() - t0, 3)}
        for key in ("tokens_generated", "http_requests", "http_retries"):
            vals = [r.get(key) for r in results if r.get(key) is not None]
            session[key] = sum(vals) if vals else None
        complete = all(r.get("complete", True) for r in results) and \
            len(records) == len(tasks) * cfg.prompts.candidates
        return self.finish(out, records, complete, session, results)

    def _dedup_run(self, records: list[dict[str, Any]]) -> None:
        """MinHash within the run, in prompt order: the first of near-duplicates is kept."""
        if not self.cfg.filters.dedup:
            return
        index = new_index(self.cfg)
        kept = [r for r in records if r["kept"]]
        for b in range(0, len(kept), 256):
            chunk = kept[b : b + 256]
            for r, sig in zip(chunk, index.signatures([r["candidate"] for r in chunk])):
                hit = index.query(sig)
                if hit is None:
                    index.add(r["id"], sig)
                else:
                    r["kept"], r["reason"] = False, "duplicate_in_run"
                    r["detail"] = f"{hit[0]} ~{hit[1]:.2f}"

    def finish(self, out: Path, records: list[dict[str, Any]], complete: bool,
               session: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
        cfg = self.cfg
        topic = cfg.prompts.topic_slot or None
        if topic and not any(topic in r["slots"] for r in records):
            topic = None
        summary = summarize(records, topic, (cfg.judge.scale_min, cfg.judge.scale_max))
        session["candidates_per_s"] = round(session["candidates"] / session["seconds"], 3) \
            if session["seconds"] else None
        gen = self.generator
        name = getattr(gen, "name", None) or cfg.generator.url or cfg.generator.checkpoint
        summary.update({"complete": complete, "generator": name, "tasks": len(results),
                        "session": session, "config": asdict(cfg)})
        _write_atomic(out / LOG_NAME, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                              for r in records))
        kept_lines = []
        for r in records:
            if r["kept"]:
                meta = {k: r[k] for k in ("prompt_id", "prompt", "slots", "critique", "score",
                                          "tokens")}
                kept_lines.append(Document(r["id"], r["candidate"], meta).to_json() + "\n")
        _write_atomic(out / KEPT_NAME, "".join(kept_lines))
        _write_atomic(out / STATS_NAME, json.dumps(summary, indent=2))
        _write_atomic(out / REPORT_NAME, html_summary(summary))
        logger.info("%s", terminal_summary(summary))
        return summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
