"""Probe: bik's fixed-order CPU matmul (bik.kernels.cpu.matmul_f32) vs torch.mm, fp32.

b is a transposed nn.Linear weight view (w.t(), K contiguous), as the ops layer passes it;
--b-contiguous uses a row-major [K, N] b instead. FLOP model: 2*M*N*K. Times are p20/p50/p80
of repeated calls after a warm-up. Prints a table, then one JSON line per record.

    PYTHONPATH=python python bench/cpu_matmul_probe.py [--ms 600] [--b-contiguous]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from bik.kernels import cpu

MS = (1, 64, 256)
NKS = ((4096, 4096), (1024, 1024), (14336, 4096))


def _time(fn, budget_s: float) -> tuple[float, float, float]:
    fn()
    times = []
    t_end = time.perf_counter() + budget_s
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=10)
    return q[1], statistics.median(times), q[7]


def run(m: int, n: int, k: int, budget_s: float, b_contiguous: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g) if b_contiguous else torch.randn(n, k, generator=g).t()
    out = torch.empty(m, n)
    bik_t = _time(lambda: cpu.matmul_f32(a, b, None, out), budget_s)
    torch_t = _time(lambda: torch.mm(a, b), budget_s)
    flops = 2.0 * m * n * k
    return {
        "M": m, "N": n, "K": k, "b_layout": "row-major" if b_contiguous else "w.t()",
        "bik_ms_p20_p50_p80": [round(t * 1e3, 3) for t in bik_t],
        "torch_ms_p20_p50_p80": [round(t * 1e3, 3) for t in torch_t],
        "bik_gflops": round(flops / bik_t[1] / 1e9, 1),
        "torch_gflops": round(flops / torch_t[1] / 1e9, 1),
        "ratio_bik_over_torch": round(bik_t[1] / torch_t[1], 2),
        "isa": cpu.isa(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "time": time.time(),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=int, default=600, help="time budget per measurement (ms)")
    p.add_argument("--b-contiguous", action="store_true", help="row-major b instead of w.t()")
    args = p.parse_args()
    if not cpu.available():
        raise SystemExit(cpu.unavailable_reason())
    recs = [run(m, n, k, args.ms / 1e3, args.b_contiguous) for n, k in NKS for m in MS]
    print(f"{'M':>4} {'N':>6} {'K':>5}  {'bik ms':>9} {'torch ms':>9}  {'bik GF/s':>8} "
          f"{'torch GF/s':>10} {'ratio':>6}")  # fmt: skip
    for r in recs:
        print(f"{r['M']:>4} {r['N']:>6} {r['K']:>5}  {r['bik_ms_p20_p50_p80'][1]:>9.2f} "
              f"{r['torch_ms_p20_p50_p80'][1]:>9.2f}  {r['bik_gflops']:>8.1f} "
              f"{r['torch_gflops']:>10.1f} {r['ratio_bik_over_torch']:>6.2f}")  # fmt: skip
    for r in recs:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
