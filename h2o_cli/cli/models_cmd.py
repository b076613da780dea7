"""`h2o models`: the aliases, where each one's weights are, and what it needs."""

from __future__ import annotations

import json

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import stdout_console


def models(as_json: opt.Json = False) -> None:
    """List model aliases, whether their weights are on this machine, and the memory they need.

    Examples:

      h2o models
      h2o models --json
    """
    from h2o_cli.models import describe_presets

    rows = describe_presets()
    if as_json:
        print(json.dumps(rows))
        return
    from rich.table import Table

    table = Table(title="models (--model ALIAS, or any hub id, folder or .gguf file)")
    for column in ("alias", "hub id", "family", "params", "weights fp32/bf16", "on this machine"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["alias"] + (" (default)" if row["default"] else ""),
            row["hub_id"],
            row["family"],
            f"{row['params_b']:g} B",
            f"{row['fp32_gib']:.1f} / {row['bf16_gib']:.1f} GiB",
            row["local"] if row["supported"] else f"{row['local']}; {row['note']}",
        )
    stdout_console().print(table)
