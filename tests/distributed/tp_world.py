"""Run scenarios on W gloo ranks (spawned processes); each scenario asserts on every rank.

One world runs several scenarios one after the other (a spawn costs every rank its imports of
torch and bik, a few seconds on two cores, which was most of a small scenario's time): after
each scenario every rank passes a barrier and records the scenario done. The first failure
ends the world; the scenarios before it passed on every rank, the failing one carries its
rank's traceback, and those after it did not run.

Bounded: the process group has a 60 s timeout (a rank waiting for a peer that died raises),
and the whole world is killed after ``deadline`` seconds.
"""

from __future__ import annotations

import datetime
import importlib
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bik.cli.common import end_spawned_rank

__all__ = ["WorldRun", "run_world"]

PG_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, world: int, init_file: str, module: str, scenarios: list[str],
           record: str) -> None:
    torch.set_num_threads(1)  # W ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=PG_TIMEOUT)
    try:
        scenario_module = importlib.import_module(module)
        for scenario in scenarios:
            getattr(scenario_module, scenario)(rank, world)
            dist.barrier()
            with open(f"{record}.{rank}", "a") as done:
                done.write(scenario + "\n")
    except BaseException:
        # Written before this rank exits, so before a peer can see it gone: the parent reads
        # every rank's traceback, the first one written first (torch.multiprocessing reports
        # whichever failed rank it notices, often a peer's "connection closed" instead).
        with open(f"{record}.{rank}.error", "w") as error:
            error.write(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    end_spawned_rank()


@dataclass
class WorldRun:
    """What one world did: the scenarios that passed on every rank; the one that failed (with
    the failing rank's traceback); the rest did not run."""

    scenarios: list[str]
    passed: list[str] = field(default_factory=list)
    failed: str | None = None
    message: str = ""

    def not_run(self) -> list[str]:
        done = {*self.passed, self.failed}
        return [s for s in self.scenarios if s not in done]


def run_world(world: int, scenarios: list[str] | str, tmp_path, *,
              module: str = "tp_scenarios", deadline: float = 240.0) -> WorldRun:
    """Run ``scenarios`` (names in ``module``) in order on ``world`` ranks."""
    scenarios = [scenarios] if isinstance(scenarios, str) else list(scenarios)
    stamp = f"{world}-{time.monotonic_ns()}"
    init_file = os.path.join(tmp_path, f"pg-{stamp}")
    record = os.path.join(tmp_path, f"done-{stamp}")
    run = WorldRun(scenarios)
    ctx = mp.start_processes(_entry, args=(world, init_file, module, scenarios, record),
                             nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > end:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks ran past {deadline} s")
    except Exception as exc:  # noqa: BLE001 - a rank's failure, reported on its scenario
        errors = sorted(Path(tmp_path).glob(f"done-{stamp}.*.error"), key=os.path.getmtime)
        run.message = "\n".join(e.read_text() for e in errors) or f"{type(exc).__name__}: {exc}"
    done = [set(Path(f"{record}.{r}").read_text().split()) if Path(f"{record}.{r}").exists()
            else set() for r in range(world)]
    run.passed = [s for s in scenarios if all(s in d for d in done)]
    if run.message:  # a failure after every scenario passed is the last one's (its teardown)
        run.failed = next((s for s in scenarios if s not in run.passed), scenarios[-1])
        run.passed = [s for s in run.passed if s != run.failed]
    return run
