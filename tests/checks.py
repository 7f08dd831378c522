"""Small helpers every op's tests share (op-specific bodies live in tests/<op>/)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch
from bik._env import flag

__all__ = ["ACCURACY_FLOOR", "ACCURACY_RATIO", "DTYPES", "EVERY_M", "FULL", "GPU_M_MAX",
           "accuracy_bound", "alone_rows", "assert_invariant", "bits_equal",
           "check_grads_against_stock", "child_with", "cpu_flags", "cpu_mul_add", "first_bad_m", "grad_rows",
           "grads_of", "max_err", "randn", "sequential_row_sum"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# BIK_TEST_FULL=1 (`make test-all`): a sweep sized for CI runs at its full size. A sized-down
# sweep keeps every claim in CI (each case it drops repeats one it keeps, at another size).
FULL = flag("BIK_TEST_FULL")

# Accuracy against fp64: bik's max error may be at most RATIO x the error of an independent
# implementation in the same dtype (torch on the CPU) plus FLOOR x eps(dtype) x scale. The
# ratios are about twice the worst measured ones; each op's tests state what they measured.
ACCURACY_RATIO = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
ACCURACY_FLOOR = 2.0


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_invariant(reports) -> None:
    """Every InvarianceReport is ok; else the summaries of the ones that are not."""
    bad = [r.summary() for r in reports if not r.ok]
    assert not bad, "\n".join(bad)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def accuracy_bound(dtype: torch.dtype, indep: torch.Tensor, ref: torch.Tensor) -> float:
    """The bound above for an output of ``dtype``, given an independent result and fp64 ref."""
    scale = ref.abs().max().item()
    return ACCURACY_RATIO[dtype] * max_err(indep, ref) + ACCURACY_FLOOR * torch.finfo(
        dtype).eps * scale


def grad_rows(forward, k: int):
    """fn(rows [M, k + n]) -> d/dx sum(forward(x) * u) with x = rows[:, :k], u = rows[:, k:]:
    per row, the input and its fixed upstream gradient side by side, so a row's upstream
    gradient is the same alone or inside a batch (for the invariance harness)."""

    def fn(rows: torch.Tensor) -> torch.Tensor:
        x = rows[:, :k].detach().clone().requires_grad_()
        u = rows[:, k:]
        out = forward(x)
        torch.autograd.backward(out, u.reshape(out.shape))
        return x.grad

    return fn


def grads_of(fn, inputs, upstream) -> list:
    """The .grad of fresh leaf copies of ``inputs`` after backpropagating ``upstream`` (a
    sequence, one per output of ``fn``)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, upstream)
    return [t.grad for t in leaves]


def check_grads_against_stock(bik_fn, stock_fn, inputs, upstream, *, ratio: float,
                              floor: float) -> None:
    """bik's gradients have the inputs' dtypes and shapes, and a normalised max error against
    fp64 autograd of ``stock_fn`` (max |grad - ref| / max |ref|) of at most ``ratio`` x stock
    autograd's own error in the same dtype, or ``floor`` x eps(dtype)."""
    ref = grads_of(stock_fn, [t.double() for t in inputs], [u.double() for u in upstream])
    got = grads_of(bik_fn, inputs, upstream)
    stock = grads_of(stock_fn, inputs, upstream)
    eps = torch.finfo(inputs[0].dtype).eps
    for i, (g, s, r) in enumerate(zip(got, stock, ref)):
        assert g.dtype == inputs[i].dtype and g.shape == inputs[i].shape
        scale = r.abs().max().clamp_min(1e-30)
        err = ((g.double() - r).abs().max() / scale).item()
        err_stock = ((s.double() - r).abs().max() / scale).item()
        assert err <= max(ratio * err_stock, floor * eps), (i, err, err_stock)


def sequential_row_sum(terms: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 as acc = acc + terms[m], m ascending, in fp32 (the CPU backend's order)."""
    acc = torch.zeros_like(terms[0])
    for m in range(terms.shape[0]):
        acc = acc + terms[m]
    return acc


# GPU sweeps: every M up to 128, then powers of two, their odd neighbours and a few others.
GPU_M_MAX = 4096
EVERY_M = sorted(set(range(1, 129)) | {p + d for p in (256, 512, 1024, 2048) for d in (-1, 0, 1)}
                 | {1000, 3000, GPU_M_MAX - 1, GPU_M_MAX})


def alone_rows(fn, pool: torch.Tensor) -> torch.Tensor:
    """fn applied to each row of ``pool`` alone, concatenated."""
    return torch.cat([fn(pool[i:i + 1]) for i in range(pool.shape[0])])


def first_bad_m(fn, pool: torch.Tensor, alone: torch.Tensor) -> int | None:
    """The first M of EVERY_M whose batch of pool[:M] differs from the rows alone (None: none)."""
    from bik.testing.harness import same_bits

    for m in EVERY_M:
        if not same_bits(fn(pool[:m]), alone[:m]):
            return m
    return None


def cpu_mul_add(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU backend's product on contract.h's mul-add fp32 sequence (the one CUDA's SIMT fp32
    kernel shares), whichever sequence this process's CPU products run: a [M, K] @ b [K, N]
    (+ bias [N]), fp32, the K-split of bik.configs.matmul_split."""
    from bik.configs import matmul_split
    from bik.ops.matmul.cpu import matmul_f32

    out = torch.empty(a.shape[0], b.shape[1])
    matmul_f32(a.float(), b.float(), None if bias is None else bias.float().contiguous(), out,
               split=matmul_split(torch.float32, b.shape[1], a.shape[1]).split, fp32_fma=False)
    return out


@cache
def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    flags = [line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")]
    return set(flags[0].split(":", 1)[1].split()) if flags else set()


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """fp32 x and y hold the same bits, any NaN equal to any NaN (no contract fixes NaN
    payloads)."""
    same = x.view(torch.int32) == y.view(torch.int32)
    return bool((same | (x.isnan() & y.isnan())).all())


def child_with(env_var: str, value: str, code: str, case, tmp_path) -> list[str]:
    """Runs ``code`` in a fresh Python with ``env_var=value`` (read at import, so it needs a
    process of its own), ``case`` saved with torch.save to the file it gets as argv[1]; returns
    its stdout's words (asserting it exited 0)."""
    import subprocess
    import sys

    path = tmp_path / f"case-{env_var}-{value}.pt"
    torch.save(case, path)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, env=dict(os.environ, **{env_var: value}), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()
