"""`scaletrain data dedup --method exact|minhash|semantic`."""

from __future__ import annotations

from scaletrain.commands._data_common import guarded, run_and_report, stage_parser


def _main(argv: list[str]) -> int:
    from scaletrain.curate.dedup import ExactDedup, MinHashDedup, SemanticDedup
    from scaletrain.curate.pipeline import Step

    p = stage_parser("dedup", "Remove exact, near (MinHash) or semantic duplicates.")
    p.add_argument("--method", choices=("exact", "minhash", "semantic"), default="minhash")
    p.add_argument(
        "--level",
        choices=("document", "line", "paragraph"),
        default="document",
        help="exact: remove duplicate documents, lines or paragraphs",
    )
    p.add_argument(
        "--preset",
        choices=("fineweb", "nemo"),
        default="fineweb",
        help="minhash: fineweb (word 5-grams, 14x8) or nemo (24-char, 20x13)",
    )
    p.add_argument("--shingle", choices=("word", "char"), default=None)
    p.add_argument("--ngram", type=int, default=None)
    p.add_argument("--bands", type=int, default=None)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="minhash: Jaccard for --verify (preset default); semantic: cosine (0.9)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="minhash: drop only candidates whose true Jaccard >= threshold",
    )
    p.add_argument(
        "--model",
        default=None,
        help="semantic: local sentence-transformers model (default: all-MiniLM-L6-v2)",
    )
    p.add_argument("--clusters", type=int, default=None, help="semantic: k-means clusters")
    args = p.parse_args(argv)
    step: Step
    if args.method == "exact":
        step = ExactDedup(level=args.level)
    elif args.method == "minhash":
        step = MinHashDedup(
            args.preset,
            args.shingle,
            args.ngram,
            args.bands,
            args.rows,
            args.threshold,
            args.verify,
        )
    else:
        step = SemanticDedup(
            args.threshold if args.threshold is not None else 0.9, args.clusters, args.model
        )
    return run_and_report([step], args.input, args.output, args)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
