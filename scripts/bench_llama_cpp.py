"""Decode tok/s of the embedded model: ours (full, H2O 10%) vs llama.cpp on the same GGUF, same thread count.

Needs llama-cpp-python (a source build: see ENV-NOTES for the CMAKE_ARGS that avoid AMX on these VMs).
    python scripts/bench_llama_cpp.py
"""

import os

import torch

torch.set_num_threads(1)
from h2o_cli import bench
from h2o_cli.models import load_model, resolve

m, t = load_model()
ids = bench.book_ids(t, 1100)
gguf = resolve("smollm2-135m").location
print("load", os.getloadavg())
for round_ in range(2):
    full = bench.decode_speed(m, ids, 1024, "full", "1", 32, 256)
    h2o = bench.decode_speed(m, ids, 1024, "h2o", "102", 32, 256)
    cpp = bench.llama_cpp_speed(__import__("pathlib").Path(gguf), 1024, 32, 1)
    print(
        f"round {round_}: ours full {full:.2f} tok/s, ours h2o10% {h2o:.2f}, llama.cpp {cpp:.2f}; full/cpp {full / cpp:.3f}, h2o/cpp {h2o / cpp:.3f}"
    )
