"""`scaletrain models [--json]`: the presets with their dimensions and exact parameter counts
(total and active per token; for Mixture-of-Experts presets, experts as top-k/E)."""

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
    columns = ["name", "arch", "params", "active_params", "experts", "expert_ffn_dim",
               "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
               "ffn_dim", "vocab_size", "max_seq_len", "sliding_window", "tie_embeddings"]
    headers = {"active_params": "active", "expert_ffn_dim": "expert_ffn"}
    for col in columns:
        table.add_column(headers.get(col, col),
                         justify="left" if col in ("name", "arch") else "right")
    for row in rows:
        table.add_row(*(_cell(row, c) for c in columns))
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze columns into 80 characters
        console = Console(width=220)
    console.print(table)
    return 0


def _cell(row: dict, column: str) -> str:
    """One table cell: counts with separators; experts as top-k/E ('-' for dense models)."""
    if column in ("params", "active_params"):
        return f"{row[column]:,}"
    if column == "experts":
        return f"{row['experts_per_token']}/{row['n_experts']}" if row["n_experts"] else "-"
    if column in ("sliding_window", "expert_ffn_dim"):
        return str(row[column] or "-")
    return str(row[column])
