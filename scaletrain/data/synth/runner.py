"""The resumable generate -> critique -> filter loop of `scaletrain data synth`.

Output directory:
  candidates.jsonl  the log: one record per candidate (prompt, candidate, critique, score,
                    kept / reason), appended one chunk of prompts at a time and fsynced
  kept.jsonl        the kept candidates as documents (written at the end, temp name + rename)
  stats.json, report.html   monitoring (computed from the log)

Resume: the log is the completion marker. On start it is read back; a prompt is done when all
its `candidates` records are there. A torn tail (a crash in the middle of a write) is cut off,
so its prompts are generated again; done prompts are never generated again, and the dedup
index is rebuilt from the kept records in log order, so decisions match an uninterrupted run.
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

from scaletrain.data.documents import Document
from scaletrain.data.synth.config import SynthConfig
from scaletrain.data.synth.critique import ClassifierCritic, Critic, JudgeCritic
from scaletrain.data.synth.filters import Decontaminator, MinHashIndex
from scaletrain.data.synth.generators import (
    BudgetExhausted,
    Generator,
    LocalGenerator,
    SamplingParams,
)
from scaletrain.data.synth.http_client import HTTPGenerator
from scaletrain.data.synth.monitor import html_summary, summarize, terminal_summary
from scaletrain.data.synth.prompts import PromptTask, build_prompts, read_values

logger = logging.getLogger(__name__)
LOG_NAME, KEPT_NAME, STATS_NAME, REPORT_NAME = ("candidates.jsonl", "kept.jsonl", "stats.json",
                                                "report.html")


def make_generator(checkpoint: str, url: str, g: Any) -> Generator:
    if url:
        return HTTPGenerator(url, model=g.model, chat=g.chat,
                             concurrency=getattr(g, "concurrency", 4),
                             timeout_s=getattr(g, "timeout_s", 120.0),
                             max_retries=getattr(g, "max_retries", 4),
                             max_requests=getattr(g, "max_requests", 0))
    return LocalGenerator.from_checkpoint(checkpoint, device=getattr(g, "device", "cpu"),
                                          batch_size=getattr(g, "batch_size", 16),
                                          token_budget=getattr(g, "token_budget", 0))


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


class SynthRunner:
    """Generator, critic and filters wired from a config; `run()` returns the summary."""

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
        from scaletrain.data.registry import build_step

        self.steps = [build_step(spec) for spec in f.curation]
        for s in self.steps:
            if hasattr(s, "fit"):
                raise ValueError(f"filters.curation: '{s.name}' needs a whole-corpus pass; use "
                                 "filters.dedup / dedup_corpus for deduplication here")
        self.index = MinHashIndex(f.dedup_threshold, shingle=f.dedup_shingle,
                                  ngram=f.dedup_ngram) if f.dedup or f.dedup_corpus else None
        if self.index is not None and f.dedup_corpus:
            from scaletrain.data.io.readers import read_documents

            n = self.index.add_texts((f"corpus:{d.id}", d.text)
                                     for d in read_documents(list(f.dedup_corpus)))
            logger.info("dedup: indexed %d corpus documents", n)
        self.decontam = None
        if f.decontaminate:
            texts = [t for path in f.decontaminate for t in read_values(path)]
            self.decontam = Decontaminator(texts, f.decontam_ngram)

    # --- filtering --------------------------------------------------------------------------
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
        if self.index is not None:
            sig = self.index.signatures([doc.text])[0]
            hit = self.index.query(sig)
            if hit is not None:
                key, sim = hit
                rec["reason"] = "duplicate_of_corpus" if key.startswith("corpus:") else \
                    "duplicate_in_run"
                rec["detail"] = f"{key} ~{sim:.2f}"
                return
            self.index.add(rec["id"], sig)
        rec["kept"] = True

    # --- the loop ---------------------------------------------------------------------------
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

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        tasks = make_tasks(cfg)
        by_id = {t.id: t for t in tasks}
        log_path = out / LOG_NAME
        records = read_log(log_path, by_id, cfg.prompts.candidates)
        if self.index is not None:  # rebuild the run's dedup state from what was kept
            self.index.add_texts((r["id"], r["candidate"]) for r in records if r["kept"])
        done = {r["prompt_id"] for r in records}
        todo = [t for t in tasks if t.id not in done]
        if done:
            logger.info("resuming: %d of %d prompts already done", len(done), len(tasks))
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
                records += new
                made += len(new)
                dt = time.perf_counter() - t0
                logger.info("prompts %d/%d, candidates %d (kept %d), %.2f candidates/s",
                            len(done) + c + len(new) // cfg.prompts.candidates, len(tasks),
                            len(records), sum(r["kept"] for r in records), made / dt)
        seconds = time.perf_counter() - t0
        return self.finish(out, records, complete, seconds, made)

    def finish(self, out: Path, records: list[dict[str, Any]], complete: bool, seconds: float,
               made: int) -> dict[str, Any]:
        cfg = self.cfg
        topic = cfg.prompts.topic_slot or None
        if topic and not any(topic in r["slots"] for r in records):
            topic = None
        summary = summarize(records, topic, (cfg.judge.scale_min, cfg.judge.scale_max))
        summary.update({
            "complete": complete, "generator": getattr(self.generator, "name", "?"),
            "session": {"candidates": made, "seconds": round(seconds, 3),
                        "candidates_per_s": round(made / seconds, 3) if seconds else None,
                        "tokens_generated": getattr(self.generator, "tokens_generated", None),
                        "http_requests": getattr(self.generator, "requests_sent", None),
                        "http_retries": getattr(self.generator, "retries", None)},
            "config": asdict(cfg)})
        tmp = out / (KEPT_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                if r["kept"]:
                    meta = {k: r[k] for k in ("prompt_id", "prompt", "slots", "critique",
                                              "score", "tokens")}
                    f.write(Document(r["id"], r["candidate"], meta).to_json() + "\n")
        os.replace(tmp, out / KEPT_NAME)
        for name, text in ((STATS_NAME, json.dumps(summary, indent=2)),
                           (REPORT_NAME, html_summary(summary))):
            (out / (name + ".tmp")).write_text(text)
            os.replace(out / (name + ".tmp"), out / name)
        logger.info("%s", terminal_summary(summary))
        return summary
