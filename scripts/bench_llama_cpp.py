"""Decode tok/s of the embedded model: ours (full, H2O 10%) vs llama.cpp on the same GGUF, same thread count.

Needs llama-cpp-python (a source build: see ENV-NOTES for the CMAKE_ARGS that avoid AMX on these VMs).
    python scripts/bench_llama_cpp.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from h2o_cli import bench
from h2o_cli.models import load_model, resolve


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    ids = bench.book_ids(tokenizer, 1100)
    gguf = Path(resolve("smollm2-135m").location)
    print("load average", os.getloadavg())
    for round_ in range(2):
        full = bench.decode_speed(model, ids, 1024, "full", "1", 32, 256)
        h2o = bench.decode_speed(model, ids, 1024, "h2o", "102", 32, 256)
        cpp = bench.llama_cpp_speed(gguf, 1024, 32, 1)
        print(
            f"round {round_}: ours full {full:.2f} tok/s, ours h2o10% {h2o:.2f}, llama.cpp {cpp:.2f}; "
            f"full/cpp {full / cpp:.3f}, h2o/cpp {h2o / cpp:.3f}"
        )


if __name__ == "__main__":
    main()
