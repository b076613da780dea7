"""`h2o models`: the aliases, where each one's weights are, what it needs, and its lead head if calibrated."""

from __future__ import annotations

import json

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import stdout_console


def models(as_json: opt.Json = False) -> None:
    """List model aliases, whether their weights are on this machine, the memory they need, and the lead head
    `h2o calibrate` found for them (what `--recall-lead auto` takes).

    Examples:

      h2o models
      h2o models --json
    """
    from h2o_cli.models import PRESETS, describe_presets
    from h2o_cli.models.calibration import kept, kept_for

    rows, found = describe_presets(), kept()
    for row in rows:
        preset = PRESETS[row["alias"]]
        names = {preset.alias, preset.hub_id, preset.hub_id.rsplit("/", 1)[-1]}
        if preset.gguf_file:
            names |= {preset.gguf_file, preset.gguf_file.removesuffix(".gguf")}
        calibrated = kept_for(names, found)
        lead = (calibrated or {}).get("lead")
        row["calibrated"] = calibrated is not None
        row["lead_head"] = f"{lead[0]}.{lead[1]}" if lead else None
    if as_json:
        print(json.dumps(rows))
        return
    from rich.table import Table

    table = Table(title="models (--model ALIAS, or any hub id, folder or .gguf file)")
    for column in (
        "alias",
        "hub id",
        "family",
        "params",
        "weights fp32/bf16",
        "on this machine",
        "lead head",
    ):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["alias"] + (" (default)" if row["default"] else ""),
            row["hub_id"],
            row["family"],
            f"{row['params_b']:g} B",
            f"{row['fp32_gib']:.1f} / {row['bf16_gib']:.1f} GiB",
            row["local"] if row["supported"] else f"{row['local']}; {row['note']}",
            row["lead_head"] or ("none found" if row["calibrated"] else "not calibrated"),
        )
    stdout_console().print(table)
