"""Fine-tuning on the same Trainer: task data, a model prepared per method, and checkpoints
that hold only what trains for LoRA/QLoRA.

Run directory: `config.toml`, `finetune.json` (method, task, base, labels: what `predict`,
`generate` and `convert` need), `metrics.jsonl`, `checkpoints/step-N/` (resume), and for
LoRA/QLoRA `adapter/` in PEFT's format.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from scaletrain.checkpoint.integrity import verification
from scaletrain.checkpoint.sharded_load import LoadTimer
from scaletrain.config import Config, ConfigError
from scaletrain.finetune import data as ftdata
from scaletrain.finetune.base import FinetuneError, check_base_manifest, load_base
from scaletrain.finetune.base_pin import base_record, check_base
from scaletrain.finetune.format import ADAPTER_DIR
from scaletrain.finetune.freeze import memory_report, param_report
from scaletrain.finetune.frozen_dtype import store_frozen
from scaletrain.finetune.heads import SequenceClassifier, classification_scores
from scaletrain.finetune.lora import LoRASettings, parse_targets
from scaletrain.finetune.methods import apply_method, with_head
from scaletrain.inference.finetuned import FINETUNE_META
from scaletrain.models.args import ModelArgs
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.fp8 import apply_fp8
from scaletrain.plan.finetune.flops import finetune_flops_per_token
from scaletrain.plan.finetune.plan import FUSED_LOSS_CLASSIFICATION, finetune_layout_problem
from scaletrain.train.checkpoint import Checkpointer
from scaletrain.train.evaluate import evaluate
from scaletrain.train.metrics import truncate_jsonl
from scaletrain.train.trainer import Trainer
from scaletrain.train.trainer_loop import TrainResult

log = logging.getLogger(__name__)

META_NAME = FINETUNE_META
# Data-parallel fine-tuning: DDP, or FSDP's ZeRO-2/3 (`auto` is DDP: `with_ddp_default`).
FINETUNE_MODES = ("ddp", "zero2", "zero3")


class AdapterCheckpointer(Checkpointer):
    """Saves and restores only the trainable parameters (adapters, heads) and their optimizer
    state: the frozen base is the base checkpoint, so it is not copied into every step."""

    def _state(self, model: nn.Module, optimizer: Any, extra: dict[str, Any],
               positional: bool = False) -> dict[str, Any]:
        core = getattr(model, "module", model)  # names without DDP's prefix
        model_sd = {k: v for k, v in core.state_dict(keep_vars=True).items()
                    if isinstance(v, nn.Parameter) and v.requires_grad}
        if isinstance(optimizer, torch.optim.Optimizer):
            optim_sd = get_optimizer_state_dict(model, optimizer)
        else:
            optim_sd = optimizer.state_dict()
        return {"model": model_sd, "optimizer": optim_sd, "extra": extra}

    def _set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any],
                   positional: bool = False) -> None:
        result = getattr(model, "module", model).load_state_dict(state["model"], strict=False)
        if result.unexpected_keys:
            raise FinetuneError(f"checkpoint holds tensors this model lacks: "
                                f"{result.unexpected_keys[:5]}")
        if isinstance(optimizer, torch.optim.Optimizer):
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])


def compute_dtype(name: str, autocast_dtype: str) -> torch.dtype:
    """QLoRA's matmul dtype: `auto` follows the run's autocast dtype (bf16 or fp32)."""
    if name == "auto":
        name = "bf16" if autocast_dtype in ("bf16", "fp16") else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def read_meta(output: str | Path) -> dict[str, Any]:
    path = Path(output) / META_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FinetuneError(f"{path} is missing or damaged: {e}") from None


def check_config(cfg: Config) -> None:
    """The refusals that need neither the model nor the data (`finetune --dry-run` too)."""
    ft = cfg.finetune
    if not ft.base:
        raise ConfigError("finetune.base is required: a HF model directory, a native "
                          "checkpoint or a training run (--base DIR)")
    if not ft.data:
        raise ConfigError("finetune.data is required: a JSON-lines file (--data PATH)")
    if ft.method == "qlora" and cfg.precision.param_dtype != "fp32":
        raise ConfigError("--method qlora keeps its own 4-bit base; use precision.param_dtype "
                          "fp32 (the adapters are small) and finetune.quant_compute_dtype")
    if ft.train_biases:  # the LoRA targets (Llama-family projections) carry no trained bias
        raise ConfigError("finetune.train_biases is not supported: LoRA adapters are written "
                          "for PEFT with bias 'none'; set it false (use --method full or "
                          "freeze to train biases)")
    if cfg.precision.fp8 != "none" and ft.method in ("lora", "qlora"):
        raise ConfigError(f"precision.fp8 runs the base's linears as torchao float8 linears, "
                          f"which --method {ft.method} wraps with adapters; use fp8 with "
                          "--method full or freeze, or set precision.fp8 none")
    if cfg.training.fused_loss and ft.task == "classification":
        raise ConfigError(FUSED_LOSS_CLASSIFICATION)


def with_ddp_default(cfg: Config) -> Config:
    """`cfg` with `parallel.data_parallel auto` read as fine-tuning reads it: DDP (a copy;
    the trainer and `finetune --dry-run` both run and plan this)."""
    if cfg.parallel.data_parallel != "auto":
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.parallel.data_parallel = "ddp"
    return cfg


def fit_seq_len(seq_len: int, limit: int, fit: bool) -> int:
    """The sequence length a run uses with a base of context `limit`: `seq_len`, lowered to
    `limit` when `fit` (the preset's default, not the user's choice); else an error if longer."""
    if fit and seq_len > limit:
        log.info("data.seq_len %d -> %d: the base model's max_seq_len", seq_len, limit)
        return limit
    if seq_len > limit:
        raise ConfigError(f"data.seq_len ({seq_len}) exceeds the base model's max_seq_len "
                          f"({limit}); lower --data.seq_len")
    return seq_len


class FinetuneTrainer(Trainer):
    """`Trainer` with the base model, method and task of `cfg.finetune`."""

    def __init__(self, cfg: Config, fit_seq_len: bool = False) -> None:
        """`fit_seq_len`: data.seq_len is a default, not the user's choice, so it is lowered to
        the base model's max_seq_len where it is longer (instead of an error)."""
        self.fit_seq_len = fit_seq_len
        check_config(cfg)
        cfg = with_ddp_default(cfg)
        ft = cfg.finetune
        self.ft = ft
        if ft.method in ("lora", "qlora"):
            self.checkpointer_cls = AdapterCheckpointer
        self.labels: list[str] | None = None
        check_base_manifest(ft.base)  # before the run directory is written
        super().__init__(cfg)
        # Every rank's load (seconds, bytes read, peak RSS): logged, and kept in finetune.json
        self.load_reports = [r.as_dict() for r in self.par.gather_objects(self.load_report)]
        if self.is_main:
            worst = max(self.load_reports, key=lambda r: r["peak_rss_bytes"])
            log.info("base load: %.2f s (slowest rank), peak host RSS %.1f MiB (largest rank), "
                     "%s", max(r["seconds"] for r in self.load_reports),
                     worst["peak_rss_bytes"] / 2**20, self._load_path())
        self.flops_per_token = self._flops_per_token()
        if self.is_main:
            self._write_meta()

    def _flops_per_token(self) -> float:
        """The matmuls this method runs per token (`plan/finetune/flops.py`): the TFLOP/s and
        MFU of the logs, as `finetune --dry-run` and `plan --method` count them."""
        ft = self.ft
        lora = ft.method in ("lora", "qlora")
        return finetune_flops_per_token(
            self.model_args, self.cfg.data.seq_len, ft.method, rank=ft.lora_rank,
            targets=self.lora.targets if lora else None, train_last=ft.train_last,
            freeze_first=ft.freeze_first, freeze_embeddings=ft.freeze_embeddings,
            train_norms=ft.train_norms and lora,
            num_labels=len(self.labels) if ft.task == "classification" else None)

    # --- construction -----------------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, ft = self.cfg, self.ft
        # Under FSDP or TP each rank reads only the parts it will hold, once the layout is
        # applied (`base_sharded`); QLoRA quantizes one layer at a time, keeping its part
        # under torchrun (`qlora_load`), on one process before the adapters are made
        self.sharded_load = ft.method == "qlora" or self.par.enabled and (
            self.par.mode in ("zero2", "zero3") or self.par.dims.tp > 1)
        with verification(cfg.checkpoint.verify), LoadTimer() as timer:
            self.base = load_base(ft.base, "cpu" if ft.method == "qlora" else self.device,
                                  weights=not self.sharded_load)
        self.load_report = None if self.sharded_load else timer.report(
            sum(p.numel() * p.element_size() for p in self.base.model.parameters()))
        self._check_base_on_resume()
        seq_len = cfg.data.seq_len = fit_seq_len(cfg.data.seq_len, self.base.args.max_seq_len,
                                                  self.fit_seq_len)
        records = ftdata.read_jsonl(ft.data)
        if ft.val_data:
            train, val = records, ftdata.read_jsonl(ft.val_data)
        else:
            train, val = ftdata.split(records, cfg.data.val_fraction, cfg.training.seed)
        if ft.task == "classification":
            self.labels = ftdata.label_set(train + val, ft.labels)
            self._check_labels_on_resume()
            make = lambda recs: ftdata.classification_dataset(recs, self.base, self.labels,  # noqa: E731
                                                              seq_len)
            train_ds, val_ds = make(train), make(val)
        else:
            train_ds = ftdata.sft_dataset(train, self.base, seq_len, ft.packing)
            val_ds = ftdata.sft_dataset(val, self.base, seq_len, ft.packing)
        from scaletrain.data.loader import BatchStream

        self.pin_memory = self.device.type == "cuda"
        if len(train_ds) < self.mbs * self.dp_size:  # a small dataset: smaller batches
            fit = len(train_ds) // self.dp_size
            if fit < 1:
                raise ConfigError(f"{len(train_ds)} training items are fewer than the "
                                  f"{self.dp_size} data-parallel ranks; add data or use fewer "
                                  "processes")
            log.warning("micro_batch_size lowered from %d to %d: the training set has only %d "
                        "items (%d data-parallel rank(s))", self.mbs, fit, len(train_ds),
                        self.dp_size)
            self.mbs = cfg.training.micro_batch_size = fit
        n_samples = cfg.training.steps * self.mbs * self.ga * self.dp_size
        order = ftdata.Epochs(train_ds, cfg.training.seed, ftdata.epochs_for(train_ds, n_samples))
        self.train_stream = BatchStream(order, self.mbs, pin_memory=self.pin_memory,
                                        dp_rank=self.dp_rank, dp_size=self.dp_size)
        self.val_data = val_ds
        self.corpus = SimpleNamespace(tokenizer_path=self.base.tokenizer_path,
                                      vocab_size=self.base.args.vocab_size,
                                      eos_id=self.base.eos_id)
        log.info("data: %d training and %d validation items", len(train_ds), len(val_ds))

    def _check_base_on_resume(self) -> None:
        path = self.output / META_NAME
        if self.resume_from is not None and path.is_file():
            check_base(read_meta(self.output), self.base.directory, path,
                       allow=self.ft.allow_base_mismatch)

    def _check_labels_on_resume(self) -> None:
        path = self.output / META_NAME
        if self.resume_from is not None and path.is_file():
            saved = read_meta(self.output).get("labels")
            if saved is not None and saved != self.labels:
                raise FinetuneError(f"the label set {self.labels} does not match the head this run "
                                    f"was started with ({saved}); resume with the same labels")

    def _check_distributed(self) -> None:
        """The layouts fine-tuning runs (`plan.finetune.finetune_layout_problem`), refused
        before the process group starts or the base is read; then the trainer's checks."""
        d, mode = self.par.dims, self.par.mode
        problem = finetune_layout_problem(
            self.ft.method, tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep,
            data_parallel=mode if mode in FINETUNE_MODES else "zero1",
            classification=self.ft.task == "classification")
        if problem:
            raise ConfigError(problem)
        super()._check_distributed()

    @functools.cached_property
    def resolved_model_args(self) -> ModelArgs:
        """The base's dimensions, from its config (the layout is checked against them before
        the weights are read)."""
        from scaletrain.inference.loader import model_args_of

        return model_args_of(self.ft.base)

    def _model_args(self) -> ModelArgs:
        return self.base.args

    def _build_model(self) -> nn.Module:
        ft = self.ft
        backbone = self.base.model
        if ft.method in ("lora", "qlora") and backbone.args.arch != "llama":
            raise FinetuneError(f"--method {ft.method} writes PEFT adapters for Llama models; "
                                f"this base is '{backbone.args.arch}': use --method full or freeze")
        lora = None
        if ft.method in ("lora", "qlora"):
            lora = self.lora = LoRASettings(ft.lora_rank, ft.lora_alpha, ft.lora_dropout,
                                            parse_targets(ft.lora_targets))
        apply_method(backbone, ft.method, lora=lora, freeze_embeddings=ft.freeze_embeddings,
                     freeze_first=ft.freeze_first, train_last=ft.train_last,
                     norms=ft.train_norms,
                     quant_dtype=compute_dtype(ft.quant_compute_dtype, self.dtype),
                     device=self.device, seed=self.cfg.training.seed,
                     load_quantized=None if self.par.enabled or ft.method != "qlora"
                     else lambda meta: self._materialize(meta, meta))
        if ft.method in ("full", "freeze"):  # frozen linears run fp8 forward matmuls too
            apply_fp8(backbone, self.cfg.precision.fp8, self.device)
        model = with_head(backbone, len(self.labels or []) if ft.task == "classification"
                          else None, self.cfg.training.seed)
        model.train()
        # precision.param_dtype bf16: the frozen base in bf16 in every layout, before it is
        # sharded or read (`frozen_dtype.py`); the trainable parameters follow pre-training
        store_frozen(model, self.cfg.precision.param_dtype)
        self.params = param_report(model)  # of the whole model, before any sharding
        self.memory = memory_report(model)
        log.info("%s fine-tuning (%s): %s of %s parameters trainable (%.2f%%)", ft.method,
                 ft.task, f"{self.params.trainable:,}", f"{self.params.total:,}",
                 100 * self.params.fraction)
        log.info("memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                        for k, v in self.memory.items()))
        # The training path's order: TP, then activation checkpointing and compile, then
        # FSDP/DDP (`parallel/parallelize.py`).
        if self.par.enabled:
            self._tensor_parallel(model)
        apply_ac(backbone, self.cfg.activation_checkpoint)
        apply_compile(backbone, self.cfg.compile,
                      self.par.mesh.all_groups() if self.par.enabled else ())
        if self.cfg.compile.enabled and self.par.dims.tp > 1:  # as `Parallelism.build_model`
            backbone.tok_embeddings.register_forward_hook(lambda _m, _i, out: out.clone())
        if not self.par.enabled:
            return model
        model = self._data_parallel(model)
        if self.sharded_load and self.load_report is None:  # (QLoRA under DDP: read already)
            self._materialize(model, backbone)  # the whole layout is applied
        return model

    def _tensor_parallel(self, model: nn.Module) -> None:
        """Under torchrun: QLoRA's NF4 layers in their shardable form (`qlora_shard.py`);
        with `parallel.tp`, the blocks split as in pre-training and LoRA adapters with them
        (`lora_tp.py`), frozen parameters kept frozen."""
        if self.ft.method == "qlora":
            from scaletrain.finetune.qlora_shard import shardable_nf4

            shardable_nf4(model)
        cfg = self.cfg.parallel
        if self.par.dims.tp == 1:
            return
        from scaletrain.finetune.lora_tp import adapter_plan
        from scaletrain.parallel.tp import apply_tp

        backbone = model.backbone if isinstance(model, SequenceClassifier) else model
        frozen = {n for n, p in backbone.named_parameters() if not p.requires_grad}
        apply_tp(backbone, self.par.mesh["tp"], sequence_parallel=cfg.sequence_parallel,
                 loss_parallel=cfg.loss_parallel, block_plan=adapter_plan)
        for name, p in backbone.named_parameters():  # DTensor parameters are made anew
            p.requires_grad_(name not in frozen)

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        """Under torchrun, after `_tensor_parallel`: DDP over the data-parallel ranks (frozen
        parameters are not reduced; with TP or 16-bit parameters, replicas whose gradients the
        step sums, as in pre-training), or FSDP's ZeRO-2/3 with `parallel.data_parallel
        zero2|zero3` (each block a unit, gathered in `par.fsdp_param_dtype`; frozen parameters
        are sharded too and get no gradient, QLoRA's NF4 codes and scales as well)."""
        d, cfg = self.par.dims, self.cfg.parallel
        mode = self.par.mode
        backbone = model.backbone if isinstance(model, SequenceClassifier) else model
        dp = d.dp_replicate * d.dp_shard
        if mode == "ddp":
            if d.tp == 1 and self.par.ddp_wrapped:  # fp32 parameters (16-bit: replicas)
                from scaletrain.parallel.ddp import apply_ddp

                if self.sharded_load:  # QLoRA, read before DDP broadcasts the replicas
                    self._materialize(model, backbone)

                return apply_ddp(model, self.par.mesh["dp_cp"], cfg.bucket_cap_mb)
            if dp > 1:  # replicas (of the TP-sharded model): the step sums their gradients
                self.par.grad_sync_group = self.par.mesh.group("dp_cp")
            return model
        from scaletrain.parallel.fsdp import apply_fsdp

        apply_fsdp(model, self.par.mesh["dp_shard_cp"], layers=backbone.layers,
                   reshard_after_forward=mode == "zero3", param_dtype=self.par.fsdp_param_dtype,
                   reduce_dtype=cfg.fsdp_reduce_dtype, cpu_offload=cfg.cpu_offload)
        return model

    def _materialize(self, model: nn.Module, backbone: nn.Module) -> None:
        """Each rank reads its parts of the base into the laid-out meta model (TP, FSDP, both:
        `base_sharded`); QLoRA's 4-bit layers are quantized one at a time (`qlora_load`; on
        one process, then made bitsandbytes layers)."""
        if self.ft.method == "qlora":
            from scaletrain.finetune.qlora_load import materialize_qlora

            fill = functools.partial(materialize_qlora, bitsandbytes=not self.par.enabled)
        else:
            from scaletrain.finetune.base_sharded import materialize as fill
        with verification(self.cfg.checkpoint.verify):
            self.load_report = fill(model, backbone, self.base,
                                    torch.device("cpu") if self.cfg.parallel.cpu_offload
                                    else self.device)

    def _load_path(self) -> str:
        """How the base was read, in words (for the load log line)."""
        if not self.sharded_load:
            return "whole base on each process"
        if not self.par.enabled:  # (one process: QLoRA)
            return "4-bit layers quantized one at a time"
        if self.ft.method == "qlora" and self.par.mode == "ddp":
            return "4-bit layers quantized one at a time on each replica"
        return "sharded: each rank read its shards"

    def _write_meta(self) -> None:
        ft = self.ft
        meta = {
            "format": "scaletrain-finetune", "version": 1, "method": ft.method, "task": ft.task,
            "base": str(Path(ft.base).resolve()), **base_record(self.base.directory),
            "labels": self.labels,
            "seq_len": self.cfg.data.seq_len, "packing": ft.packing,
            "lora": None if ft.method not in ("lora", "qlora") else {
                "rank": self.lora.rank, "alpha": self.lora.alpha, "dropout": self.lora.dropout,
                "targets": list(self.lora.targets), "train_norms": ft.train_norms},
            "params": {"trainable": self.params.trainable, "total": self.params.total},
            "memory_bytes": self.memory,
            "base_load": self.load_reports,
        }
        tmp = self.output / (META_NAME + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.replace(self.output / META_NAME)

    # --- steps ------------------------------------------------------------------------------
    def _inputs(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = {k: v.to(self.device, non_blocking=self.pin_memory) for k, v in x.items()}
        if self.ft.task == "sft" and not self.ft.packing:
            x.pop("segment_ids", None)  # one example per row: the causal mask is enough
        return x

    def next_batches(self) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for _ in range(self.ga):
            x, y = next(self.train_stream)
            out.append((self._inputs(x), y.to(self.device, non_blocking=self.pin_memory)))
        return out

    def model_forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**x)

    def hidden_forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        """Final-norm hidden states (`training.fused_loss`, SFT): the trainer's chunked head
        and cross-entropy take them with the labels, never building the logits."""
        return self.model(**x, hidden=True)

    def save_checkpoint(self) -> Path:
        path = super().save_checkpoint()
        if self.ft.method in ("lora", "qlora"):
            from scaletrain.finetune.peft_io import adapter_tensors, save_adapter

            core = self.core
            head = core.score if isinstance(core, SequenceClassifier) else None
            backbone = core.backbone if head is not None else core
            # Under FSDP every rank takes part in gathering the adapter's shards.
            tensors = adapter_tensors(backbone, head, self.ft.train_norms) \
                if self.par.enabled else None
            if self.is_main:
                save_adapter(self.output / ADAPTER_DIR, backbone, self.lora,
                             base_path=str(Path(self.ft.base).resolve()), head=head,
                             train_norms=self.ft.train_norms, tensors=tensors)
        return path

    def train(self) -> TrainResult:
        """`Trainer.train`; `classification.jsonl` first loses the records past the step this
        run starts from, as `metrics.jsonl` and `eval.jsonl` do (a resumed run writes them
        again; a fresh run starts them anew)."""
        if self.is_main:
            truncate_jsonl(self.output / "classification.jsonl", self.step)
        return super().train()

    # --- evaluation -------------------------------------------------------------------------
    def eval_prepare(self, x: dict[str, torch.Tensor], y: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self._inputs(x), y.to(self.device)

    def evaluate_tensor(self) -> torch.Tensor:
        """Validation loss over the whole held-out split (the trainer's one evaluation path);
        classification also logs accuracy and macro-F1 (into `classification.jsonl`)."""
        preds: list[torch.Tensor] = []
        golds: list[torch.Tensor] = []

        def collect(logits: torch.Tensor, y: torch.Tensor, real: torch.Tensor) -> None:
            preds.append(logits.argmax(-1).cpu()[real])
            golds.append(y.cpu()[real])

        classify = self.ft.task == "classification"
        loss = evaluate(self.model, self.par, self.val_data, 0, self.mbs, self.device,
                        self.dtype, self.eval_loss, prepare=self.eval_prepare,
                        forward=self.eval_forward, on_batch=collect if classify else None,
                        hidden=self.cfg.training.fused_loss)
        if classify:
            parts = self.par.gather_objects((torch.cat(preds), torch.cat(golds)))
            scores = classification_scores(torch.cat([p for p, _ in parts]),
                                           torch.cat([g for _, g in parts]), len(self.labels))
            self.last_scores = scores
            log.info("step %5d | validation accuracy %.4f | macro-F1 %.4f", self.step,
                     scores["accuracy"], scores["macro_f1"])
            if self.is_main:
                with (self.output / "classification.jsonl").open("a") as f:
                    f.write(json.dumps({"step": self.step, "val_loss": float(loss), **scores})
                            + "\n")
        return loss

    def sample(self, max_new_tokens: int) -> str | None:
        return None  # `scaletrain predict` generates from the fine-tuned model


__all__ = ["FinetuneTrainer", "AdapterCheckpointer", "META_NAME", "read_meta"]
