"""`scaletrain models [--json]`: the presets with their dimensions and exact parameter counts."""

from __future__ import annotations

import argparse
import json

from scaletrain.models.args import preset_table


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scaletrain models", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON list of objects")
    args = parser.parse_args(argv)
    rows = preset_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scaletrain model presets")
    columns = ["name", "arch", "params", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
               "ffn_dim", "vocab_size", "max_seq_len", "sliding_window", "tie_embeddings"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "arch") else "right")
    for row in rows:
        table.add_row(*(f"{row[c]:,}" if c == "params" else str(row[c] or "-")
                        if c == "sliding_window" else str(row[c]) for c in columns))
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze columns into 80 characters
        console = Console(width=180)
    console.print(table)
    return 0
