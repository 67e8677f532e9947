"""`scaletrain eval` runs lm-evaluation-harness in-process, and lm_eval's own `local-completions`
model against a `scaletrain serve` started here gets the same results, on tiny local tasks of
each request kind (loglikelihood, multiple choice, generate_until, loglikelihood_rolling)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from scaletrain.commands import eval as eval_cmd  # noqa: E402
from scaletrain.commands.serve import make_server  # noqa: E402
from scaletrain.inference.generators import LocalGenerator  # noqa: E402
from tests.helpers.synth import tiny_checkpoint  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval_tasks"
TASKS = {
    "tiny_ll": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
  - {metric: acc, aggregation: mean, higher_is_better: true}""",
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{q}}"
doc_to_target: " {{a}}"
generation_kwargs: {until: ["."], max_gen_toks: 6, do_sample: false, temperature: 0}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}""",
    "tiny_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity}
  - {metric: byte_perplexity}
  - {metric: bits_per_byte}""",
}


def write_tasks(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in TASKS.items():
        data = directory / f"{name}.jsonl"
        shutil.copy(DATA / f"{name}.jsonl", data)
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}\n")
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    ckpt = tiny_checkpoint(root / "ckpt")
    tok = root / "hf-tokenizer"  # lm_eval's client reads the tokenizer with transformers
    tok.mkdir()
    shutil.copy(next(ckpt.glob("*tokenizer.json")), tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return ckpt, tok, write_tasks(root / "tasks")


def _metrics(results: dict) -> dict[str, dict[str, float]]:
    return {task: {k: v for k, v in m.items() if isinstance(v, (int, float)) and "stderr" not in k}
            for task, m in results["results"].items()}


def _flat(x) -> list:
    """Numbers and strings of a sample's responses, in order."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    return [x]


def _responses(results: dict) -> dict[str, list]:
    return {task: [_flat(s["filtered_resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def test_in_process_equals_lm_eval_through_serve(setup, tmp_path):
    ckpt, tok, tasks = setup
    out = tmp_path / "results.json"
    args = eval_cmd.build_parser().parse_args(
        ["--checkpoint", str(ckpt), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
         "--batch-size", "3", "--bootstrap-iters", "0", "--output", str(out)])
    local_run = eval_cmd.run(args, log_samples=True)
    local = _metrics(local_run)
    assert set(local) == set(TASKS)
    assert local["tiny_rolling"]["word_perplexity,none"] > 1

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    gen = LocalGenerator.from_checkpoint(ckpt, batch_size=4)
    server = make_server(gen, "127.0.0.1", 0, "tiny", batch_size=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        remote = simple_evaluate(
            model="local-completions", tasks=list(TASKS), task_manager=TaskManager(
                include_path=str(tasks), include_defaults=False), bootstrap_iters=0,
            model_args={"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": "tiny",
                        "tokenizer": str(tok), "max_length": 128})
    finally:
        server.shutdown()
        server.server_close()
        server.engine.close()
    served = _metrics(remote)
    assert set(served) == set(local)
    for task, metrics in local.items():
        for name, value in metrics.items():
            assert served[task][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, name)
    mine, theirs = _responses(local_run), _responses(remote)
    for task in TASKS:
        for a, b in zip(mine[task], theirs[task], strict=True):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert y == (pytest.approx(x, rel=1e-4, abs=1e-5) if isinstance(x, float) else x)
    assert any(r[0].strip() for r in mine["tiny_gen"])  # the model did generate text


def test_bad_checkpoint_is_a_clear_error(setup, capsys):
    ckpt, _, tasks = setup
    assert eval_cmd.main(["--checkpoint", str(ckpt / "nope"), "--tasks", "tiny_ll",
                          "--include-path", str(tasks)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_prints_the_table_and_writes_results(setup, tmp_path, capsys):
    ckpt, _, tasks = setup
    out = tmp_path / "r.json"
    assert eval_cmd.main(["--checkpoint", str(ckpt), "--tasks", "tiny_mc", "--include-path",
                          str(tasks), "--bootstrap-iters", "0", "--output", str(out)]) == 0
    assert "acc_norm" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "acc,none" in data["results"]["tiny_mc"] and data["scaletrain"]["eval_s"] > 0


def test_equals_lm_eval_hf_backend_on_a_gemma2_checkpoint_whose_tokenizer_adds_bos(tmp_path):
    """`scaletrain eval` on a Hugging Face folder gives lm_eval's own `hf` backend (HFLM, on the
    same folder) the same numbers, with a tokenizer that prepends BOS as Llama / Gemma ones do."""
    transformers = pytest.importorskip("transformers")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from scaletrain.evaluation.harness import ScaletrainLM
    from tests.helpers.family import hf_model
    from tests.helpers.synth import TEXT

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=100,
                                                      special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = hf_model("gemma2")
    hf.config.bos_token_id, hf.config.eos_token_id = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    hf.save_pretrained(tmp_path / "m")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp_path / "m")
    tasks = write_tasks(tmp_path / "tasks")

    def run(lm):
        return simple_evaluate(model=lm, tasks=list(TASKS), bootstrap_iters=0, log_samples=True,
                               task_manager=TaskManager(include_path=str(tasks),
                                                        include_defaults=False))

    theirs = run(HFLM(pretrained=str(tmp_path / "m"), device="cpu", batch_size=4,
                      dtype="float32"))
    lm = ScaletrainLM(checkpoint=str(tmp_path / "m"), batch_size=4)
    mine = run(lm)
    bos = tok.token_to_id("<s>")
    assert lm.tok_encode("the cat")[0] == bos and lm.tok_encode("<s>the cat").count(bos) == 1
    plain = ScaletrainLM(gen=lm.gen, add_bos_token=False)  # what --add-bos-token false gives
    assert plain.tok_encode("the cat") == lm.tok_encode("the cat")[1:]
    assert eval_cmd.build_parser().parse_args(
        ["--checkpoint", "x", "--tasks", "t", "--add-bos-token", "false"]).add_bos_token == "false"
    for task in TASKS:
        for a, b in zip(_responses(mine)[task], _responses(theirs)[task], strict=True):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert y == (pytest.approx(x, rel=1e-4, abs=1e-5) if isinstance(x, float) else x)
    for task, metrics in _metrics(mine).items():
        for name, value in metrics.items():
            assert _metrics(theirs)[task][name] == pytest.approx(value, rel=1e-4), (task, name)


def _samples(directory: Path) -> dict[str, list[dict]]:
    out = {}
    for f in sorted(directory.rglob("samples_*.jsonl")):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        out[task] = sorted((json.loads(x) for x in f.read_text().splitlines()),
                           key=lambda s: s["doc_id"])
    return out


def test_log_samples_and_chat_flags_equal_lm_eval_cli(setup, tmp_path):
    """`scaletrain eval` with lm_eval's everyday flags writes the per-sample logs lm_eval's own
    CLI (`lm-eval run --model scaletrain ...`, same model) writes, record for record; the chat
    template and the system instruction reach the prompts."""
    from lm_eval._cli import HarnessCLI

    ckpt, _, tasks = setup
    chat = tmp_path / "chat-ckpt"
    shutil.copytree(ckpt, chat)
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}")}))
    flags = ["--tasks", "tiny_gen,tiny_mc", "--include_path", str(tasks), "--limit", "3",
             "--log_samples", "--apply_chat_template", "--system_instruction", "be brief",
             "--gen_kwargs", "temperature=0,max_gen_toks=4", "--batch_size", "2",
             "--device", "cpu"]
    ours = tmp_path / "ours"
    assert eval_cmd.main(["--checkpoint", str(chat), "--output", str(ours / "r.json"),
                          "--bootstrap-iters", "0",
                          *[f.replace("_", "-") if f.startswith("--") else f
                            for f in flags]]) == 0
    theirs = tmp_path / "theirs"
    cli = HarnessCLI()
    cli.execute(cli._parser.parse_args(["run", "--model", "scaletrain", "--model_args",
                                        f"checkpoint={chat}", "--output_path",
                                        str(theirs / "r.json"), *flags]))
    mine, want = _samples(ours), _samples(theirs)
    assert set(mine) == set(want) == {"tiny_gen", "tiny_mc"}
    for task in want:
        assert len(mine[task]) == len(want[task]) == 3
        for a, b in zip(mine[task], want[task]):
            assert {k: v for k, v in a.items()} == {k: v for k, v in b.items()}
    prompt = mine["tiny_gen"][0]["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.startswith("<system> be brief <user> ") and prompt.endswith("<assistant> ")
    assert mine["tiny_gen"][0]["arguments"]["gen_args_0"]["arg_1"]["max_gen_toks"] == 4
