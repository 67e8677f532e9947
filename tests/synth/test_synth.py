"""Synthetic data: batched generation, prompts, critique parser, filters, resumable runner."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scaletrain.inference.generation import generate, generate_batch
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.synth.config import load_config
from scaletrain.synth.critique import JudgeCritic, parse_score
from scaletrain.synth.filters import Decontaminator, MinHashIndex
from scaletrain.synth.monitor import distinct_n, self_bleu
from scaletrain.synth.prompts import build_prompts
from scaletrain.synth.runner import LOG_NAME, SynthRunner, task_log
from tests.helpers.synth import ScriptedGenerator, tiny_checkpoint
from tests.helpers.synth import lines as _lines

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_generation_matches_one_at_a_time(arch):
    args = ModelArgs(arch=arch, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                     max_seq_len=64)
    model = build_model(args, seed=0).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(5)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]
    single = [generate(model, p, 10) for p in prompts]
    assert generate_batch(model, prompts, 10) == single  # left padding changes nothing
    seeds = [11, 12, 13, 14]
    sampled = [generate(model, p, 10, temperature=1.0, top_p=0.9, seed=s)
               for p, s in zip(prompts, seeds)]
    assert generate_batch(model, prompts, 10, temperature=1.0, top_p=0.9, seeds=seeds) == sampled
    # a row that meets eos stops there while the others go on
    eos = single[0][2]
    out = generate_batch(model, prompts, 10, eos_id=eos)
    for row, full in zip(out, single):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)


def test_rubric_with_literal_braces_is_refused_before_any_generation():
    calls = []
    gen = ScriptedGenerator(lambda p, s: calls.append(p) or "Score: 5")
    with pytest.raises(ValueError, match="literal braces"):
        JudgeCritic(gen, rubric='{prompt} {candidate} reply as {"score": N}')
    assert calls == []
    ok = JudgeCritic(gen, rubric='{prompt} {candidate} reply as {{"score": N}}')
    assert ok.critique(["p"], ["c"])[0].score == 5 and calls == ['p c reply as {"score": N}']


def test_parse_score_robust():
    assert parse_score("Clear and correct.\nScore: 8") == 8
    assert parse_score("**Rating:** 7/10") == 7
    assert parse_score('{"score": 9, "why": "good"}') == 9
    assert parse_score("Score: 4 out of 5") == 8  # rescaled to the 1..10 scale
    assert parse_score("Score: 3 out of 5") == 6
    assert parse_score("I'd give it 4 out of 5") is None  # not the designated score pattern
    assert parse_score("It handles 1/2 of the cases. Score: 7") == 7
    assert parse_score("It handles 1/2 of the cases well.") is None
    assert parse_score('{"score": "7"}') == 7 and parse_score('{"Score": "4/5"}') == 8
    assert parse_score("7/10") == 7
    assert parse_score("  6 ") == 6
    assert parse_score("Score: 7.5") == 7.5
    assert parse_score("no idea what to say") is None
    assert parse_score("Score: 42") is None  # out of range
    assert parse_score("the the cat mat 3 dogs") is None


def test_prompts_are_seeded_and_fill_slots():
    slots = {"topic": ["rain", "tides", "rivers"], "level": ["child", "expert"]}
    a = build_prompts("Explain {topic} to a {level}.", slots, 10, seed=3)
    b = build_prompts("Explain {topic} to a {level}.", slots, 10, seed=3)
    c = build_prompts("Explain {topic} to a {level}.", slots, 10, seed=4)
    assert [t.prompt for t in a] == [t.prompt for t in b] != [t.prompt for t in c]
    assert all(t.prompt == f"Explain {t.slots['topic']} to a {t.slots['level']}." for t in a)
    assert len({t.id for t in a}) == 10
    few = build_prompts("{examples}\n\nNow: {topic}", {"topic": ["x"]}, 2, seed=0,
                        examples=["E1", "E2", "E3"], fewshot_k=2)
    assert few[0].prompt.count("E") == 2
    with pytest.raises(ValueError, match="topic"):
        build_prompts("About {topic}", {}, 3)


def test_minhash_index_and_decontamination():
    idx = MinHashIndex(threshold=0.7, ngram=3)
    base = "the quick brown fox jumps over the lazy dog near the river bank today"
    idx.add("a", idx.signatures([base])[0])
    near = idx.query(idx.signatures([base + " again"])[0])
    assert near is not None and near[0] == "a"
    assert idx.query(idx.signatures(["completely different words about stars and space"])[0]) \
        is None
    dec = Decontaminator(["What is the capital of France? Paris is the capital city.",
                          "two words"], n=5)
    assert dec.match("Q: what is the capital of France, really?") == "what is the capital of"
    assert dec.match("this has Two Words inside") == "two words"
    assert dec.match("nothing in common here at all") is None


def _config(tmp_path, **over):
    base = {"output": str(tmp_path / "out"), "chunk_prompts": 2,
            "generator.checkpoint": "unused",
            "prompts.template": "Write about {topic}.", "prompts.num_prompts": 6,
            "prompts.candidates": 2, "prompts.slots.topic": ["rain", "snow", "wind"]}
    base.update(over)
    return load_config(None, base)


def _judge_scores(scores):
    """A judge whose reply to the i-th candidate text (the candidate ends with '#i') is
    scores[i] (a number) or unparsable text (None)."""
    def reply(prompt, seed):
        i = int(prompt.split("#")[-1].split()[0])
        return f"Score: {scores[i]}" if scores[i] is not None else "I cannot judge this."
    return ScriptedGenerator(reply)


def _distinct_candidates(prompt, seed):
    return f"{prompt} unique words {seed} alpha{seed % 97} beta{seed % 89} #{seed % 12}"


def test_threshold_unparsable_and_dedup_drop_what_they_should(tmp_path):
    # 12 candidates (6 prompts x 2): candidate text index = global order
    counter = iter(range(100))

    def gen(prompt, seed):
        i = next(counter)
        if i in (3, 7):  # near-copies of candidate 0
            return "a very long shared sentence about weather and clouds over hills #" + str(i)
        if i == 0:
            return "a very long shared sentence about weather and clouds over hills #0"
        return f"distinct text number {i} about {prompt} with {i * 7} words #{i}"

    scores = [8, 9, 3, 8, None, 7, 2, 8, 8, None, 9, 6]
    cfg = _config(tmp_path, **{"filters.min_score": 5, "filters.dedup_ngram": 2,
                               "filters.dedup_threshold": 0.5})
    runner = SynthRunner(cfg, generator=ScriptedGenerator(gen),
                         critic=JudgeCritic(_judge_scores(scores)))
    s = runner.run()
    assert s["generated"] == 12
    assert s["dropped"] == {"below_threshold": 2, "critique_unparsable": 2,
                            "duplicate_in_run": 2}
    assert s["critique_unparsable"] == 2 and runner.critic.parse_failures == 2
    assert s["kept"] + sum(s["dropped"].values()) == s["generated"]  # stats add up
    recs = [json.loads(line) for line in _lines(tmp_path / "out" / LOG_NAME)]
    assert {r["id"] for r in recs if r["reason"] == "duplicate_in_run"} == {"p000001-c1",
                                                                            "p000003-c1"}
    assert all(r["critique"] is not None and "prompt" in r for r in recs)
    kept = [json.loads(line) for line in _lines(tmp_path / "out" / "kept.jsonl")]
    assert len(kept) == s["kept"] and all(k["metadata"]["score"] >= 5 for k in kept)
    assert sum(v["kept"] for v in s["topics"].values()) == s["kept"]
    assert abs(sum(v["share_kept"] for v in s["topics"].values()) - 1) < 1e-3
    assert (tmp_path / "out" / "report.html").read_text().count("<tr>") > 5


def test_dedup_against_corpus_and_decontamination(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "c1", "text": "the old mill stood by the river "
                                  "for a hundred years and more"}) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"text": "question: which planet is known as the red planet "
                                 "answer mars"}) + "\n")

    def gen(prompt, seed):
        if "rain" in prompt:
            return "the old mill stood by the river for a hundred years and more"
        if "snow" in prompt:
            return "fun fact: which planet is known as the red planet? answer mars of course"
        return f"wind blows {seed} over open fields and {seed % 13} tall trees"
    cfg = _config(tmp_path, **{"judge.kind": "none", "filters.dedup_corpus": [str(corpus)],
                               "filters.decontaminate": [str(evals)],
                               "filters.decontam_ngram": 8, "prompts.candidates": 1})
    s = SynthRunner(cfg, generator=ScriptedGenerator(gen), critic=None).run()
    by_topic = s["topics"]
    assert by_topic.get("rain", {"kept": 0})["kept"] == 0
    assert by_topic.get("snow", {"kept": 0})["kept"] == 0
    assert s["dropped"].get("duplicate_of_corpus", 0) == by_topic.get("rain", {}).get(
        "generated", 0)
    assert s["dropped"].get("contaminated", 0) == by_topic.get("snow", {}).get("generated", 0)
    assert s["kept"] == by_topic["wind"]["generated"]


def test_killed_run_resumes_without_duplicates_or_losses(tmp_path):
    cfg = _config(tmp_path, **{"judge.kind": "none", "prompts.num_prompts": 7})
    crashing = ScriptedGenerator(_distinct_candidates, fail_after_calls=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        SynthRunner(cfg, generator=crashing, critic=None).run()
    log = task_log(tmp_path / "out", 0)
    assert len(log.read_text().splitlines()) == 8  # 2 chunks x 2 prompts x 2 candidates
    with open(log, "a") as f:  # a crash in the middle of the next write: a torn tail
        f.write('{"id": "p000004-c0", "prompt_id": "p000004", "cand')
    again = ScriptedGenerator(_distinct_candidates)
    s = SynthRunner(cfg, generator=again, critic=None).run()
    asked = [p for call in again.calls for p in call]
    assert len(asked) == 3 * 2  # only the 3 prompts not done before
    assert len(_lines(log)) == 14
    recs = [json.loads(line) for line in _lines(tmp_path / "out" / LOG_NAME)]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 14 == s["generated"]
    assert sorted({r["prompt_id"] for r in recs}) == [f"p{i:06d}" for i in range(7)]
    # the same result as an uninterrupted run
    cfg2 = _config(tmp_path, **{"judge.kind": "none", "prompts.num_prompts": 7,
                                "output": str(tmp_path / "fresh")})
    s2 = SynthRunner(cfg2, generator=ScriptedGenerator(_distinct_candidates), critic=None).run()
    fresh = [json.loads(line) for line in _lines(tmp_path / "fresh" / LOG_NAME)]
    assert sorted((r["id"], r["candidate"], r["kept"]) for r in fresh) == \
        sorted((r["id"], r["candidate"], r["kept"]) for r in recs)
    assert s2["kept"] == s["kept"]


def test_changed_config_is_refused_on_resume(tmp_path):
    cfg = _config(tmp_path, **{"judge.kind": "none"})
    SynthRunner(cfg, generator=ScriptedGenerator(_distinct_candidates), critic=None).run()
    other = _config(tmp_path, **{"judge.kind": "none", "prompts.template": "Other {topic}."})
    with pytest.raises(ValueError, match="does not match this config"):
        SynthRunner(other, generator=ScriptedGenerator(_distinct_candidates), critic=None).run()


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="exactly one of generator.checkpoint"):
        load_config(None, {})
    with pytest.raises(ValueError, match="unknown key"):
        load_config(None, {"generator.checkpoint": "x", "generator.temprature": 1})


def test_distinct_n():
    assert distinct_n(["a b c", "a b c"], 1) == 0.5
    assert distinct_n(["a b", "c d"], 2) == 1.0


def test_self_bleu_orders_repetition_above_variety():
    same = self_bleu(["the cat sat on the mat today"] * 3)
    close = self_bleu(["the cat sat on the mat", "the cat sat on a mat", "a dog ran in the park"])
    apart = self_bleu(["alpha beta gamma delta", "one two three four", "red green blue black"])
    assert same == 1.0 and apart < 0.05 < close < same
    assert self_bleu(["only one text"]) == 0.0


def test_cli_end_to_end_in_process(tmp_path, capsys):
    from scaletrain.cli import main

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "synth"
    toml = tmp_path / "synth.toml"
    toml.write_text('[judge]\nrubric = "{prompt} {candidate} score:"\nmax_new_tokens = 4\n')
    argv = ["data", "synth", "--config", str(toml), "--checkpoint", str(ckpt),
            "--topics", "cat,dog,sun", "--num-prompts", "4", "-n", "2",
            "--max-new-tokens", "8", "--out", str(out),
            "--template", "the {topic} sat on"]
    assert main(argv) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["generated"] == 8
    assert stats["kept"] + sum(stats["dropped"].values()) == 8
    # the judge is the same random model: its replies rarely parse, and that is counted
    assert stats["critique_unparsable"] == sum(1 for line in _lines(out / LOG_NAME)
                                               if json.loads(line)["score"] is None)
    assert main(argv) == 0  # resume: everything done, nothing generated again
    assert len((out / LOG_NAME).read_text().splitlines()) == 8


def test_sigkilled_cli_run_resumes_exactly(tmp_path):
    """A real `kill -9` in the middle of a run, then the same command again."""
    import signal
    import subprocess
    import sys
    import time

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "synth"
    argv = ["data", "synth", "--checkpoint", str(ckpt), "--topics", "cat,dog,sun,rain",
            "--num-prompts", "40", "-n", "2", "--max-new-tokens", "16", "--batch-size", "2",
            "--judge", "none", "--temperature", "0.9", "--out", str(out),
            "--template", "the {topic} sat on"]
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = task_log(out, 0)
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or log.stat().st_size < 1000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(_lines(log))
    assert 0 < before < 80, "the run should have been killed part way"
    from scaletrain.cli import main

    assert main(argv) == 0
    assert len(_lines(log)) == 80
    recs = [json.loads(x) for x in _lines(out / LOG_NAME)]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 80
    assert json.loads((out / "stats.json").read_text())["generated"] == 80


def test_tasks_on_worker_processes_give_the_same_result(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    common = {"generator.checkpoint": str(ckpt), "prompts.template": "the {topic} sat on",
              "prompts.num_prompts": 6, "prompts.candidates": 2,
              "prompts.slots.topic": ["cat", "dog", "sun"], "generator.max_new_tokens": 8,
              "generator.temperature": 0.9, "judge.kind": "none", "chunk_prompts": 2}
    one = SynthRunner(load_config(None, {**common, "output": str(tmp_path / "one")})).run()
    two = SynthRunner(load_config(None, {**common, "output": str(tmp_path / "two"),
                                         "tasks": 3, "workers": 2})).run()
    assert two["tasks"] == 3 and one["generated"] == two["generated"] == 12
    assert all(task_log(tmp_path / "two", i).exists() for i in range(3))
    rows = [[(r["id"], r["candidate"], r["kept"], r["reason"])
             for r in map(json.loads, _lines(tmp_path / d / LOG_NAME))] for d in ("one", "two")]
    assert rows[0] == rows[1]
