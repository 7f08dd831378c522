"""Run a scenario on W gloo ranks (spawned processes) and fail the test with the first rank's
traceback. Scenarios live in tp_scenarios.py; each asserts on every rank.

Bounded: the process group has a 60 s timeout (a rank waiting for a peer that died raises),
and the whole world is killed after ``deadline`` seconds.
"""

from __future__ import annotations

import datetime
import importlib
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bik.cli.common import end_spawned_rank

__all__ = ["run_world"]

PG_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, world: int, init_file: str, module: str, scenario: str) -> None:
    torch.set_num_threads(1)  # W ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=PG_TIMEOUT)
    try:
        getattr(importlib.import_module(module), scenario)(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_spawned_rank()


def run_world(world: int, scenario: str, tmp_path, *, module: str = "tp_scenarios",
              deadline: float = 240.0) -> None:
    init_file = os.path.join(tmp_path, f"pg-{scenario}-{world}-{time.monotonic_ns()}")
    ctx = mp.start_processes(_entry, args=(world, init_file, module, scenario), nprocs=world,
                             join=False, start_method="spawn")
    end = time.monotonic() + deadline
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{scenario} on {world} ranks ran past {deadline} s")
