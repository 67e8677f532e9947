"""What the docs-as-tests runner (tests/helpers/doc_runner.py) adds to a doc's commands, written
down.

`INPUTS`: per doc, the files a doc names as the reader's own (their repository, their chat
data, a Hugging Face model folder they downloaded) and what the test puts there instead. They
are made in the doc's fresh folder before its first command.

`SUBSTITUTIONS`: the only changes made to a command's text, each a named rule with its reason.
They shrink sizes (steps, sequence length, corpus bytes, vocabulary) so that every doc runs on
two CPU cores within the CI budget; model dimensions are left as the doc gives them. A command
a rule changed is reported as *adapted* with the rule's name and the text that ran.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Small sizes for a training run: 2 optimizer steps of 2 sequences of 64 tokens, on the first
# 200 kB of the built-in corpus with a 512-entry tokenizer (the corpus cache is then shared).
SMALL_DATA = ("--training.micro_batch_size 2 --data.seq_len 64 --data.max_bytes 200000 "
              "--data.vocab_size 512")
SMALL_RUN = (f"--training.steps 2 {SMALL_DATA} --training.eval_sequences 2 "
             "--training.sample_tokens 4 --metrics.tensorboard false")


@dataclass(frozen=True)
class Env:
    """Where a maker works: the doc's folder, the fixtures' `shared/` (or None), the commands'
    environment, and a folder shared by the session where an input made once is kept (a
    training run or a model folder is made once and copied into each doc that names it)."""

    cwd: Path
    shared: Path | None
    env: dict[str, str]
    store: Path


Maker = Callable[[Env], None]


@dataclass(frozen=True)
class Substitution:
    name: str
    why: str
    match: str  # regex searched in the command as written
    unless: str = ""  # regex: the rule does not apply when this is found
    replace: tuple[str, str] | None = None  # (regex, replacement), applied once
    append: str = ""  # arguments added at the end (after the doc's, so they win)

    def applies(self, command: str) -> bool:
        return bool(re.search(self.match, command)) and not (
            self.unless and re.search(self.unless, command))

    def apply(self, command: str) -> str:
        if self.replace is not None:
            command = re.sub(self.replace[0], self.replace[1], command, count=1)
        return f"{command} {self.append}".strip() if self.append else command


_TRAINS = r"(^|\s)(scaletrain|-m scaletrain) (train|finetune)\b"
SUBSTITUTIONS: list[Substitution] = [
    Substitution(
        "make demo", "the Makefile's `demo` recipe (`scaletrain train --output runs/demo`) "
        "without creating .venv: the test already runs in the installed environment",
        match=r"^make demo\b", replace=(r"^make demo\b.*", "scaletrain train --output runs/demo")),
    Substitution(
        "small run", f"a training or fine-tuning run of 2 steps on small data: {SMALL_RUN}",
        match=_TRAINS, unless=r"--dry-run|--help", append=SMALL_RUN),
    Substitution(
        "two workers", "a pipeline file may ask for more worker processes (docs/curate.md: 8) "
        "than the runner starts (at most 4, on 2 cores); `--workers` overrides the file",
        match=r"(^|\s)scaletrain data curate\b.*--config\b", append="--workers 2"),
    Substitution(
        "small synth", "synthetic data from 4 prompts x 2 candidates of 8 new tokens: "
        "--num-prompts 4 --candidates 2 --max-new-tokens 8",
        match=r"(^|\s)scaletrain data synth\b", unless=r"--help",
        append="--num-prompts 4 --candidates 2 --max-new-tokens 8"),
    Substitution(
        "small profile", f"profiling on small data (the profiler's own 5 steps): {SMALL_DATA}",
        match=r"(^|\s)scaletrain profile\b", append=SMALL_DATA),
]


# ----------------------------------------------------------------------------- inputs
def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _my_repo(e: Env) -> None:
    """A source repository: the standard library's `json`, `email` and `asyncio` packages."""
    for pkg in ("json", "email", "asyncio"):
        shutil.copytree(_stdlib() / pkg, e.cwd / "my_repo" / pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))


def _my_texts(e: Env) -> None:
    """A folder of .txt files: the standard library's `email` modules renamed."""
    out = e.cwd / "my_texts"
    out.mkdir()
    for f in sorted((_stdlib() / "email").glob("*.py")):
        (out / f"{f.stem}.txt").write_text(f.read_text(encoding="utf-8"), encoding="utf-8")


def _ccnet_records(shared: Path | None) -> list[dict]:
    if shared is None:
        raise FileNotFoundError("shared/fixtures not found (set SCALETRAIN_FIXTURES)")
    records = []
    for f in sorted((shared / "fixtures" / "data").glob("ccnet_*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return records


def _web_documents(shared: Path | None, piece: int = 1500) -> list[str]:
    """The CCNet fixture documents cut at line breaks into pieces of at least `piece`
    characters (a short tail joins the piece before; documents shorter than that come first,
    whole): about 100 documents, so a 98/2 split holds a validation sample."""
    short, pieces = [], []
    for r in _ccnet_records(shared):
        text = r.get("raw_content", r.get("text"))
        if len(text) < piece:
            short.append(text)
            continue
        current = ""
        for line in text.split("\n"):
            current = f"{current}\n{line}" if current else line
            if len(current) >= piece:
                pieces.append(current)
                current = ""
        if current:
            pieces[-1] += "\n" + current
    return short + pieces


def _docs_folder(e: Env) -> None:
    """`docs/`: web documents as JSON lines (the CCNet fixtures cut into pieces)."""
    (e.cwd / "docs").mkdir()
    (e.cwd / "docs" / "web.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _web_documents(e.shared)))


def _docs_gz(e: Env) -> None:
    """`docs.jsonl.gz`: the same documents, gzip-compressed."""
    with gzip.open(e.cwd / "docs.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps({"text": t}) + "\n" for t in _web_documents(e.shared)))


def _crawl(e: Env) -> None:
    """`crawl/*.warc.gz`: the two WARC fixtures (37 HTML pages)."""
    if e.shared is None:
        raise FileNotFoundError("shared/fixtures not found (set SCALETRAIN_FIXTURES)")
    (e.cwd / "crawl").mkdir()
    for f in sorted((e.shared / "fixtures" / "data").glob("*.warc.gz")):
        shutil.copy(f, e.cwd / "crawl" / f.name)


def _wet(e: Env) -> None:
    """`wet/CC-MAIN-fixtures.warc.wet.gz`: a Common Crawl WET file of the WARC fixtures'
    37 HTML pages (one `conversion` record of extracted text each; tests/helpers/wet.py)."""
    from tests.helpers.wet import fixture_pages, write_wet

    if e.shared is None:
        raise FileNotFoundError("shared/fixtures not found (set SCALETRAIN_FIXTURES)")
    built = e.store / "wet"
    if not built.is_dir():
        built.mkdir(parents=True)
        write_wet(built / "CC-MAIN-fixtures.warc.wet.gz",
                  fixture_pages(sorted((e.shared / "fixtures" / "data").glob("*.warc.gz"))))
    shutil.copytree(built, e.cwd / "wet")


def _quality_sets(e: Env) -> None:
    """`wiki.jsonl` (the CCNet prose, as high quality) and `crawl.jsonl` (stdlib source files)."""
    (e.cwd / "wiki.jsonl").write_text("".join(
        json.dumps({"text": r.get("raw_content", r.get("text"))}) + "\n"
        for r in _ccnet_records(e.shared)))
    files = sorted((_stdlib() / "email").glob("*.py")) + sorted((_stdlib() / "json").glob("*.py"))
    (e.cwd / "crawl.jsonl").write_text("".join(
        json.dumps({"text": f.read_text(encoding="utf-8")}) + "\n" for f in files))


def _chat(e: Env) -> None:
    """`chat.jsonl`: 40 short conversations in the `messages` format."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
            for a in range(8) for b in range(5)]
    (e.cwd / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _reviews(e: Env) -> None:
    """`reviews.jsonl`: 36 labelled one-line reviews (positive, negative, neutral)."""
    words = {"positive": ["wonderful", "great", "moving"], "negative": ["dull", "awful", "flat"],
             "neutral": ["long", "recent", "french"]}
    rows = [{"text": f"a {w} film, take {i}", "label": label}
            for label, ws in words.items() for w in ws for i in range(4)]
    (e.cwd / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _my_toml(e: Env) -> None:
    """`my.toml`: your own config, here a copy of the `debug` preset."""
    shutil.copy(Path(__file__).resolve().parents[2] / "scaletrain" / "configs" / "debug.toml",
                e.cwd / "my.toml")


def _hf_llama(folder: str) -> Maker:
    def make(e: Env) -> None:
        """A Hugging Face Llama folder: transformers' LlamaForCausalLM, 2 layers of 64, random
        weights, with a 512-entry byte-level BPE trained on the stdlib's `email` package."""
        from scaletrain.data.tokenizer import EOS_TOKEN, train_bpe

        built = e.store / "hf-llama"
        if built.is_dir():
            shutil.copytree(built, e.cwd / folder)
            return
        texts = [f.read_text(encoding="utf-8") for f in sorted((_stdlib() / "email").glob("*.py"))]
        (e.cwd / folder).mkdir(parents=True)
        tok = train_bpe(texts, vocab_size=512)
        tok.save(str(e.cwd / folder / "tokenizer.json"))
        script = (
            "import sys\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,\n"
            "    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,\n"
            "    max_position_embeddings=256, bos_token_id=None, eos_token_id=int(sys.argv[2]))\n"
            "LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])\n")
        subprocess.run([sys.executable, "-c", script, str(e.cwd / folder),
                        str(tok.token_to_id(EOS_TOKEN))], check=True, capture_output=True,
                       timeout=300, env=e.env)
        shutil.copytree(e.cwd / folder, built)
    return make


def _training_run(folder: str) -> Maker:
    def make(e: Env) -> None:
        """A training run of the `debug` model (2 steps, small data)."""
        built = e.store / "debug-run"
        if not built.is_dir():
            subprocess.run(["scaletrain", "train", "--output", str(built), *SMALL_RUN.split()],
                           cwd=e.cwd, env=e.env, check=True, capture_output=True, timeout=300)
        shutil.copytree(built, e.cwd / folder)
    return make


def _hf_config(e: Env) -> None:
    """`my-model/config.json`: a Hugging Face Llama config (Llama 3.2 1B's dimensions)."""
    (e.cwd / "my-model").mkdir()
    (e.cwd / "my-model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}))


MAKERS: dict[str, Maker] = {
    "my_repo/": _my_repo,
    "my_texts/": _my_texts,
    "docs/": _docs_folder,
    "docs.jsonl.gz": _docs_gz,
    "crawl/": _crawl,
    "wet/": _wet,
    "wiki.jsonl + crawl.jsonl": _quality_sets,
    "chat.jsonl": _chat,
    "reviews.jsonl": _reviews,
    "my.toml": _my_toml,
    "llama-dir/": _hf_llama("llama-dir"),
    "hf_dir/": _hf_llama("hf_dir"),
    "runs/demo/": _training_run("runs/demo"),
    "runs/debug/": _training_run("runs/debug"),
    "my-model/config.json": _hf_config,
}

INPUTS: dict[str, tuple[str, ...]] = {
    "README.md": ("my_repo/", "chat.jsonl"),
    "docs/data.md": ("docs/", "docs.jsonl.gz", "my_repo/", "my_texts/"),
    "docs/curate.md": ("crawl/", "wet/", "wiki.jsonl + crawl.jsonl"),
    "docs/finetune.md": ("llama-dir/", "runs/demo/", "chat.jsonl", "reviews.jsonl"),
    "docs/generate.md": ("runs/debug/",),
    "docs/convert.md": ("runs/debug/", "hf_dir/"),
    "docs/synth.md": ("runs/debug/",),
    "docs/plan.md": ("my-model/config.json",),
    "docs/train.md": ("my.toml",),
}


def make_inputs(names: tuple[str, ...], where: Env) -> None:
    for name in names:
        MAKERS[name](where)


def describe_inputs() -> str:
    """The inputs table, for the report."""
    lines = []
    for doc, names in INPUTS.items():
        for name in names:
            first = (MAKERS[name].__doc__ or "").strip().splitlines()[0]
            lines.append(f"{doc:<18} {name:<26} {first}")
    return "\n".join(lines)
