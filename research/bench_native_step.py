"""One layer's C decode step in isolation (h2o_cli.cache.c_step on h2o_kernels.native.step): a full store of SmolLM2's shape (3 KV heads x 64
dims, 9 query heads), random K/V, one call per token, median time per call (the ctypes call and its Python
wrapper included). In the model the same call is slower: the weights stream through the caches between layers.

    python research/bench_native_step.py --budgets 102,410,800 --calls 3000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h2o_cli.cache.c_step import CStep
from h2o_cli.cache.store import LayerStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[102, 410, 800])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n_kv, group, head_dim = 3, 3, 64
    for budget in args.budgets:
        store = LayerStore(n_kv, head_dim, budget, args.chunk, torch.float32, torch.device("cpu"))
        store.write(torch.randn(n_kv, budget, head_dim), torch.randn(n_kv, budget, head_dim))
        store.compact()
        step = CStep(store)
        table = torch.randn(budget + args.chunk + 1, 2 * head_dim)
        times = []
        for _ in range(args.calls):
            query = torch.randn(n_kv, group, 2 * head_dim)
            key, value = torch.randn(n_kv, 1, head_dim), torch.randn(n_kv, 1, head_dim)
            started = time.perf_counter()
            step.run(query, key, value, table, True, budget + 1 - budget // 2, 1.0)
            times.append(time.perf_counter() - started)
        print(f"budget {budget}: {statistics.median(times[args.calls // 10 :]) * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
