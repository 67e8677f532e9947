"""`scaletrain data extract`: WARC (HTML responses) or HTML files to documents."""

from __future__ import annotations

from scaletrain.commands._data_common import guarded, run_and_report, stage_parser


def _main(argv: list[str]) -> int:
    from scaletrain.curate.filters import CountsFilter

    p = stage_parser(
        "extract",
        "Extract the main text of HTML pages in WARC files "
        "(trafilatura); other inputs are passed through as documents.",
    )
    p.add_argument(
        "--min-chars", type=int, default=1, help="drop extracted documents shorter than this"
    )
    args = p.parse_args(argv)
    return run_and_report([CountsFilter(min_chars=args.min_chars)], args.input, args.output, args)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
