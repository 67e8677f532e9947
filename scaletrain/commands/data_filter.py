"""`scaletrain data filter`: heuristic filters (gopher, c4, fineweb, language, url, counts)."""

from __future__ import annotations

from scaletrain.commands._data_common import guarded, parse_params, run_and_report, stage_parser


def _main(argv: list[str]) -> int:
    from scaletrain.curate.registry import ALIASES, build_step

    p = stage_parser("filter", "Apply heuristic filters, each with its published thresholds.")
    p.add_argument(
        "--filters",
        default="gopher_quality,gopher_repetition,c4,fineweb_quality",
        help="comma-separated: gopher_quality, gopher_repetition, c4, "
        "fineweb_quality, language, url, counts, code",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="STEP.PARAM=VALUE",
        help="change a threshold, e.g. --set gopher_quality.min_words=30 "
        '--set language.languages=\'["en","fr"]\'',
    )
    args = p.parse_args(argv)
    params = parse_params(args.set)
    names = [ALIASES.get(n.strip(), n.strip()) for n in args.filters.split(",") if n.strip()]
    extra = set(params) - set(names)
    if extra:
        raise ValueError(f"--set names step(s) {sorted(extra)} not in --filters {names}")
    steps = [build_step({"type": n, **params.get(n, {})}) for n in names]
    return run_and_report(steps, args.input, args.output, args)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
