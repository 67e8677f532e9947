"""Our model as an lm-evaluation-harness model (`lm_eval` registry name "scaletrain").

Scoring and generation go through the same batched decoder as `scaletrain serve`
(`models.batch_decode`), and requests are prepared the way lm_eval's `local-completions`
prepares them for a server whose context is the model's `max_seq_len` (`max_length` = that
length, one position kept back for generation; contexts left-truncated the same way), so
`scaletrain eval` and lm_eval through `serve` give the same numbers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scaletrain.optional import require

lm_eval = require("lm_eval", "scaletrain eval needs lm-evaluation-harness: pip install "
                  "'scaletrain[eval]'", ValueError)

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from scaletrain.inference.batch_decode import Row, decode_rows  # noqa: E402
from scaletrain.inference.generators import cut_at_stop  # noqa: E402

if TYPE_CHECKING:
    from scaletrain.inference.generators import LocalGenerator

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's default for API models


@register_model("scaletrain")
class ScaletrainLM(TemplateLM):
    """loglikelihood, loglikelihood_rolling and generate_until over a loaded model."""

    def __init__(self, gen: LocalGenerator | None = None, checkpoint: str | None = None,
                 batch_size: int | str = 8, device: str = "cpu", max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, **_: Any):
        super().__init__()
        if gen is None:
            if checkpoint is None:
                raise ValueError("the scaletrain lm_eval model needs checkpoint=DIR")
            from scaletrain.inference.generators import LocalGenerator

            gen = LocalGenerator.from_checkpoint(checkpoint, device=device)
        self.gen = gen
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_gen_toks = max_gen_toks
        self.max_length = gen.model.args.max_seq_len - 1  # as local-completions: 1 for output
        special = gen.special_tokens or {}
        bos = special.get("bos_token")
        self._bos_id = gen.tokenizer.token_to_id(bos) if bos else None
        self.add_bos_token = add_bos_token
        """None: the tokenizer's own special tokens (its post-processor, e.g. Llama's and
        Gemma's BOS), as lm_eval's `hf` model encodes; True/False forces them on/off."""

    # --- tokens --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.gen.eos_id if self.gen.eos_id is not None else self.gen.pad_id

    @property
    def prefix_token_id(self) -> int:
        return self._bos_id if self._bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """As lm_eval's `hf` model: the tokenizer's special tokens unless `add_bos_token` says
        otherwise, and none when the text already starts with the prefix token."""
        if add_special_tokens is None:
            prefix = self.gen.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            if prefix and string.startswith(prefix):
                add_special_tokens = False
            else:
                add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
        return self.gen.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    @property
    def tokenizer_name(self) -> str:
        return self.gen.name

    # --- chat (--apply_chat_template) ----------------------------------------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.gen.chat_template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as text through the model's chat template (the one SFT, predict
        and serve use), else the documented default format."""
        return self.gen.chat_text(chat_history, add_generation_prompt)

    # --- scoring -------------------------------------------------------------------------
    def _score(self, sequences: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of tokens ctxlen.., all of them the argmax) per sequence."""
        rows = [Row(ids, 0, logprobs=1, echo_logprobs=True) for ids, _ in sequences]
        out: list[tuple[float, bool]] = []
        for b in range(0, len(rows), self.batch_size):
            with self.gen.lock:
                done = decode_rows(self.gen.model, rows[b : b + self.batch_size],
                                   pad_id=self.gen.pad_id)
            for (_, ctxlen), d in zip(sequences[b : b + self.batch_size], done):
                lps = d.prompt_logprobs[ctxlen:]
                tops = d.prompt_top[ctxlen:]
                greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
                out.append((float(sum(lps)), greedy))  # type: ignore[arg-type]
        return out

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        seqs = []
        for _, ctx, cont in requests:
            whole = ctx + cont
            inp = whole[-self.max_length:]
            seqs.append((inp, len(ctx) - max(0, len(whole) - self.max_length)))
        return self._score(seqs)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1)]
            scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            out.append(sum(s for s, _ in scored))
        return out

    # --- generation ----------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos_text = None
        if self.gen.eos_id is not None:
            eos_text = self.gen.tokenizer.decode([self.gen.eos_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        out: list[str] = [""] * len(requests)
        for idx in groups.values():
            kw = dict(requests[idx[0]].args[1])
            kw.pop("do_sample", None)
            until = handle_stop_sequences(kw.pop("until", None), eos_text)
            budget = int(kw.pop("max_gen_toks", kw.pop("max_tokens", self.max_gen_toks)))
            temperature = float(kw.pop("temperature", 0.0))
            top_p = kw.pop("top_p", None)
            top_k = kw.pop("top_k", None)
            if kw:
                raise ValueError(f"generation settings {sorted(kw)} are not supported by "
                                 "scaletrain eval")
            keep = self.max_length - budget
            stop = self.gen.stop_check(until)
            rows = [Row(self.tok_encode(requests[i].args[0])[-keep:] if keep > 0 else [],
                        budget, seed=1234, stop=stop) for i in idx]
            for b in range(0, len(rows), self.batch_size):
                with self.gen.lock:
                    done = decode_rows(self.gen.model, rows[b : b + self.batch_size],
                                       temperature, None if top_k is None else int(top_k),
                                       None if top_p is None else float(top_p),
                                       eos_id=self.gen.stop_ids,
                                       pad_id=self.gen.pad_id)
                for i, d in zip(idx[b : b + self.batch_size], done):
                    out[i] = cut_at_stop(self.gen.decode(d.ids), until)[0]
        return out


__all__ = ["ScaletrainLM"]
