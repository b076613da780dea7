"""scripts/gpu_bench.py --dry-run: every row of the GPU bench runs on a tiny model on the CPU and lands in the table.

The dry run measures nothing; this checks that the script the next GPU lease runs is whole (every variant at
every context, every column, the kernel rows, the markers `docs/benchmarks.md` is rewritten between).
It runs in a subprocess: the Triton interpreter must be chosen before triton is first imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~15 s on 2 shared cores (imports, one torch.compile, the Triton interpreter)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bench.py"


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(tmp_path: Path, *args: str) -> dict:
    """`gpu_bench.py --dry-run ARGS` in a subprocess on the CPU: its JSON report."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'kernels'}", "TRITON_INTERPRET": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_dry_run_writes_every_row_and_column(tmp_path):
    pytest.importorskip("triton")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\nbefore\n\n<!-- gpu-bench:begin -->\nold\n<!-- gpu-bench:end -->\n\nafter\n"
    )
    report = dry_run(tmp_path, "--write", str(doc))
    bench = load_script()
    contexts = report["contexts"]
    assert contexts == [64, 128]

    # every variant at every context, each either measured or saying why not (never silently missing)
    cells = {(row["variant"], row["context"]): row for row in report["rows"]}
    assert set(cells) == {(variant, context) for variant in bench.VARIANTS for context in contexts}
    for (variant, _), row in cells.items():
        note = row.get("note") or ""
        assert not note.startswith(("failed", "skipped")), (variant, note)
        if variant == "h2o 10% captured/compiled":  # the fixed step, captured (eager backend in a dry run)
            assert note.startswith("CompiledStep"), note
        assert row["decode tok/s"] > 0 and row["cache MiB"] > 0, row
        if (
            variant == "h2o 10% Triton decode"
        ):  # decodes further on the torch row's cache: no prefill of its own
            assert row["prefill tok/s"] is None and note.startswith("continues the torch row's cache"), row
        else:
            assert row["prefill tok/s"] > 0, row
        assert row["kept"] == (row["context"] if variant.startswith("plain") else round(row["context"] * 0.1))

    # h2o keeps a tenth of the tokens, so its cache is smaller than the full KV at the longest context
    memory = report["memory_at_longest"]
    assert memory["h2o 10% torch path"] < memory["full KV (DynamicCache)"]

    # the kernel rows: decode and a prefill chunk, fused (interpreter) / torch / SDPA all timed
    kinds = [row["kind"] for row in report["kernels"]]
    assert kinds[0] == "decode" and kinds[-1].startswith("prefill chunk")
    for row in report["kernels"]:
        assert all(isinstance(row[name], float) for name in ("fused", "torch", "sdpa")), row

    # the markdown: the section replaced between its markers, the model table with every column and row
    text = doc.read_text()
    assert (
        text.startswith("# Benchmarks\n\nbefore")
        and text.rstrip().endswith("after")
        and "\nold\n" not in text
    )
    section = text[text.index("<!-- gpu-bench:begin -->") : text.index("<!-- gpu-bench:end -->")]
    assert "Dry run" in section
    header = "| " + " | ".join(bench.COLUMNS) + " |"
    assert header in section
    table = section[section.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert len(table) == len(bench.VARIANTS) * len(contexts)
    assert all(line.count(" | ") == len(bench.COLUMNS) - 1 for line in table)
    assert "| fused Triton | torch | SDPA |" in section
    assert "Cache memory at context 128" in section


def test_dry_run_in_bf16_measures_the_captured_row(tmp_path):
    """The model part in bf16, as the GPU runs it: the captured row (the fixed step under `CompiledStep`) is a
    measured row, not an error, and so is every other row."""
    report = dry_run(tmp_path, "--dtype", "bfloat16", "--only", "model", "--contexts", "64")
    assert report["model"]["dtype"] == "torch.bfloat16"
    rows = {row["variant"]: row for row in report["rows"]}
    captured = rows["h2o 10% captured/compiled"]
    assert captured["note"].startswith("CompiledStep"), captured
    assert captured["decode tok/s"] > 0 and captured["cache MiB"] > 0 and captured["kept"] == 6
    for variant, row in rows.items():
        assert not (row.get("note") or "").startswith(("failed", "skipped")), (variant, row)
