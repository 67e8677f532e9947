"""`scaletrain data quality`: model-based scores (fastText, KenLM, HF classifier) and a
threshold on any score in metadata."""

from __future__ import annotations

from scaletrain.commands._data_common import guarded, run_and_report, stage_parser


def _main(argv: list[str]) -> int:
    from scaletrain.curate.pipeline import Step
    from scaletrain.curate.quality import (
        FastTextScorer,
        HFClassifierScorer,
        PerplexityScorer,
        ScoreFilter,
        train_classifier,
    )

    p = stage_parser(
        "quality",
        "Score documents with a model and keep those within bounds. "
        "Train a fastText classifier first with --train-positive/--train-negative.",
        input_required=False,
    )
    p.add_argument("--train-positive", metavar="PATH", nargs="+",
                   help="documents of the quality you want (files, folders or globs)")
    p.add_argument("--train-negative", metavar="PATH", nargs="+",
                   help="documents you do not want (files, folders or globs)")
    p.add_argument(
        "--fasttext",
        metavar="MODEL.bin",
        help="fastText model to score with (written here when training)",
    )
    p.add_argument("--kenlm", metavar="MODEL", help="KenLM .arpa/.bin model: perplexity score")
    p.add_argument("--hf", metavar="DIR", help="local HF sequence-classification model")
    p.add_argument("--hf-label", default=None, help="HF label whose probability is the score")
    p.add_argument(
        "--key",
        default=None,
        help="metadata key of the score (default: fasttext_hq, perplexity, hf_score)",
    )
    p.add_argument("--min-score", type=float, default=None)
    p.add_argument("--max-score", type=float, default=None)
    args = p.parse_args(argv)
    if args.train_positive or args.train_negative:
        if not (args.train_positive and args.train_negative and args.fasttext):
            raise ValueError(
                "training needs --train-positive, --train-negative and "
                "--fasttext MODEL.bin (where to save it)"
            )
        from scaletrain.curate.quality.fasttext_clf import DocumentTexts

        train_classifier(DocumentTexts(args.train_positive), DocumentTexts(args.train_negative),
                         args.fasttext)
        print(f"trained fastText classifier: {args.fasttext}")
        if not args.input:
            return 0
    if not args.input or not args.output:
        raise ValueError("give --input and --output to score documents")
    steps: list[Step] = []
    if args.fasttext:
        steps.append(FastTextScorer(args.fasttext, key=args.key or "fasttext_hq"))
    if args.kenlm:
        steps.append(PerplexityScorer(args.kenlm, key=args.key or "perplexity"))
    if args.hf:
        steps.append(HFClassifierScorer(args.hf, key=args.key or "hf_score", label=args.hf_label))
    if len(steps) > 1 and args.key:
        raise ValueError("--key names one score: give one model at a time with --key")
    key = args.key or (steps[0].key if steps else None)  # type: ignore[attr-defined]
    if args.min_score is not None or args.max_score is not None:
        if key is None:
            raise ValueError(
                "--min-score/--max-score need a model or --key naming a score "
                "already in the documents' metadata"
            )
        steps.append(ScoreFilter(key, args.min_score, args.max_score))
    if not steps:
        raise ValueError("nothing to do: give --fasttext, --kenlm, --hf or --key with bounds")
    return run_and_report(steps, args.input, args.output, args)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
