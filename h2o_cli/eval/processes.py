"""`h2o eval --processes N`: one call run by N spawned processes joined in one process group, as torchrun
starts them (RANK, WORLD_SIZE, MASTER_ADDR, ... in each one's environment).

lm-eval then gives each process every N-th document; the `h2o` lm-eval model (lm_eval_model.py) scores them
with its own weights and cache and gathers the per-document metrics on rank 0, whose result comes back.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable

from h2o_cli.errors import H2OError


def run_processes(processes: int, target: Callable, payload):
    """`target(payload)` in `processes` spawned processes (module-level `target`, picklable `payload`); rank 0's
    return value. A process that fails stops the others (a collective would wait for it forever)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    workers = [
        context.Process(
            target=_rank_main, args=(rank, processes, port, target, payload, results), daemon=True
        )
        for rank in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        finished: dict[int, object] = {}
        while len(finished) < processes:
            if not results.empty():
                kind, rank, value = results.get()
                if kind == "error":
                    raise H2OError(f"process {rank} of {processes} failed:\n{value}")
                finished[rank] = value
                continue
            for rank, worker in enumerate(workers):
                if worker.exitcode not in (None, 0) and rank not in finished and results.empty():
                    raise H2OError(f"process {rank} of {processes} ended with exit code {worker.exitcode}")
            time.sleep(0.05)
        for worker in workers:
            worker.join()
        return finished[0]
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()


def _rank_main(rank: int, world: int, port: int, target: Callable, payload, results) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        value = target(payload)
        results.put(("done", rank, value if rank == 0 else None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other processes
        results.put(("error", rank, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
