"""`scaletrain data pii`: replace PII and secrets with typed placeholders."""

from __future__ import annotations

from scaletrain.commands._data_common import guarded, run_and_report, stage_parser


def _main(argv: list[str]) -> int:
    from scaletrain.curate.pii import DETECTORS, PIIRedactor

    p = stage_parser("pii", "Replace e-mails, public IPs, phones, card numbers and secrets.")
    p.add_argument(
        "--kinds",
        default=",".join(DETECTORS),
        help=f"comma-separated, some of: {', '.join(DETECTORS)}",
    )
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    return run_and_report([PIIRedactor(kinds)], args.input, args.output, args)


def main(argv: list[str]) -> int:
    return guarded(_main, argv)
