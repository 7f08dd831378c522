"""`bik bench tp`: a row-parallel linear on a gloo world, bik's ordered gather + fold against
the stock F.linear + all_reduce, with the bytes each moves per rank.

bik's layer all-gathers every rank's G/TP fp32 group totals (each rank receives the G - G/TP
it lacks: (TP - 1) * G/TP * rows * N * 4 bytes); the stock layer all-reduces one [rows, N]
(a ring moves about 2 * (TP - 1)/TP * rows * N * elem bytes per rank). The records say both,
the times (p20/p50/p80 over a fixed number of lockstep calls, rank 0's clock) and whether each
result equals one device's bits. Spawned processes: ``--tp`` ranks (default 2), one thread each.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch
from rich.table import Table

from bik._dtypes import dtype_name
from bik.cli.common import end_spawned_rank, print_table
from bik.cli.timing import noisy, quantiles_ms
from bik.configs import MATMUL_TP_MAX

SHAPES = ((4096, 4096), (1024, 14336))  # (N, K): o_proj, down_proj of Llama-3-8B
QUICK_SHAPES = ((256, 512),)
REPS = 20


def _worker(rank: int, world: int, init_file: str, out_file: str, dtype_name_: str,
            shapes: list, ms: list) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import bik
    from bik.distributed import row_parallel_linear

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    dtype = getattr(torch, dtype_name_)
    records = []
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        shard = slice(rank * k // world, (rank + 1) * k // world)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(dtype)
            xs, ws = x[:, shard].contiguous(), w[:, shard].contiguous()

            def bik_call(xs=xs, ws=ws):
                return row_parallel_linear(xs, ws)

            def stock_call(xs=xs, ws=ws):
                part = F.linear(xs, ws)
                dist.all_reduce(part)
                return part

            times = {}
            for name, fn in (("bik", bik_call), ("torch", stock_call)):
                fn()
                samples = []
                for _ in range(REPS):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t0) * 1e3)
                times[name] = quantiles_ms(samples)
            one = bik.linear(x, w)
            elem = torch.finfo(dtype).bits // 8
            groups = MATMUL_TP_MAX
            records.append({
                "op": "tp_row_parallel", "tp": world, "N": n, "K": k, "M": m,
                "dtype": dtype_name(dtype), "bik_ms": times["bik"], "torch_ms": times["torch"],
                "speedup": times["torch"]["p50"] / times["bik"]["p50"],
                "bik_bytes_in": (world - 1) * groups // world * m * n * 4,
                "torch_bytes_ring": int(2 * (world - 1) / world * m * n * elem),
                "bik_equals_one_device": bool(torch.equal(bik_call(), one)),
                "torch_equals_one_device": bool(torch.equal(stock_call(), F.linear(x, w))),
                "noisy": noisy(times["bik"], times["torch"])})
    if rank == 0:
        torch.save(records, out_file)
    dist.barrier()
    dist.destroy_process_group()
    end_spawned_rank()


def run(device, dtype, args) -> list[dict]:
    import torch.multiprocessing as mp

    if device.type != "cpu":
        raise SystemExit("bik bench tp: runs on the CPU (gloo) in this version")
    world = args.tp
    shapes = QUICK_SHAPES if args.quick else SHAPES
    ms = list(args.ms) if args.ms else ([1, 4] if args.quick else [1, 16, 128])
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "pg"), os.path.join(tmp, "records.pt")
        mp.start_processes(_worker, args=(world, init_file, out_file, str(dtype)[6:],
                                          list(shapes), ms),
                           nprocs=world, join=True, start_method="spawn")
        return torch.load(out_file)


def render(records: list[dict], console) -> None:
    table = Table(title=f"row-parallel linear on gloo ({records[0]['dtype']})")
    for col in ("TP", "N x K", "M", "bik ms", "torch ms", "speedup", "bik bytes in",
                "torch ring bytes", "bik = 1 device", "torch = 1 device", ""):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["tp"]), f"{r['N']}x{r['K']}", str(r["M"]),
                      f"{r['bik_ms']['p50']:.3f}", f"{r['torch_ms']['p50']:.3f}",
                      f"{r['speedup']:.2f}", f"{r['bik_bytes_in']:,}",
                      f"{r['torch_bytes_ring']:,}",
                      "yes" if r["bik_equals_one_device"] else "[red]NO",
                      "yes" if r["torch_equals_one_device"] else "no",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=3)


plot = None
