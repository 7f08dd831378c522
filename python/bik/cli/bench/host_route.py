"""`bik bench boundary`'s second table: host microseconds per eager call of a decode step's
ops on each backend, next to the stock torch call.

How each backend's host time is taken:

* on a GPU (Triton, CUDA C++ and torch): the device is synchronised before each call, outside
  the timing, and the timing ends when the call returns: what the call costs the host to
  enqueue its work (the launches included, the kernels' run not);
* Triton without a GPU: the dry run (``bik.runtime.triton_dry_run``): the sm_90 route's whole
  host path with the launch itself left out (so a bit less than a GPU's host time: the CUDA
  launcher's own C code and the driver call are missing);
* the CPU backend and torch on the CPU: the whole call (the CPU does the work).

Each row records what it measured (``how``), its p20/p50/p80 and the launches per call where
they can be counted.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

import bik
from bik.cli.timing import NOISY, quantiles_ms

# A Llama-3-8B decode step's shapes (bf16): one token, hidden 4096, 32 / 8 heads of 128.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, KEYS, PAGE, VOCAB = 4096, 32, 8, 128, 1024, 16, 128256


def _calls(device: torch.device, backend: str) -> dict:
    """name -> (bik's call, torch's call or None) on ``device``."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    x, w, nw = randn(1, HIDDEN), randn(HIDDEN, HIDDEN) / HIDDEN**0.5, randn(HIDDEN)
    pages = KEYS // PAGE
    kc, q = randn(pages, PAGE, KV_HEADS, HEAD_DIM), randn(1, HEADS, HEAD_DIM)
    meta = {"cache_seqlens": torch.tensor([KEYS], dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32, device=device),
            "block_table": torch.arange(pages, dtype=torch.int32, device=device)[None],
            "max_seqlen_q": 1, "max_seqlen_k": KEYS}
    logits = torch.randn(1, VOCAB, generator=gen).to(device)
    # Every row parameter as a tensor, as an engine passes them (a scalar or None is broadcast
    # per call: an aten op and a fill each).
    rows = {"seed": torch.tensor([7], device=device), "position": torch.tensor([9], device=device),
            "temperature": torch.tensor([0.8], device=device),
            "top_k": torch.tensor([0], device=device), "top_p": torch.tensor([1.0], device=device),
            "min_p": torch.tensor([0.0], device=device)}
    qt, kt = q[None].transpose(1, 2), kc.reshape(1, KEYS, KV_HEADS, HEAD_DIM).transpose(1, 2)
    return {
        f"linear 1x{HIDDEN}x{HIDDEN}": (lambda: bik.linear(x, w, backend=backend),
                                       lambda: F.linear(x, w)),
        f"rms_norm 1x{HIDDEN}": (lambda: bik.rms_norm(x, nw, 1e-5, backend=backend),
                                 lambda: F.rms_norm(x, (HIDDEN,), nw, 1e-5)),
        f"attention decode, {KEYS} keys": (
            lambda: bik.attention(q, kc, kc, **meta, backend=backend),
            lambda: F.scaled_dot_product_attention(qt, kt, kt, enable_gqa=True)),
        f"sample 1x{VOCAB}": (
            lambda: bik.sample(logits, **rows, max_top_k=0, any_top_p=False, backend=backend),
            lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1)),
    }


def _host_us(fn, sync, budget_s: float) -> dict:
    """p20/p50/p80 µs per call, sampled for about ``budget_s`` (at least 5 samples). With
    ``sync`` each call is timed alone after the device has drained; without, a sample times a
    loop of calls long enough (~1 ms) for the timer's own cost not to matter."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    loop = 1 if sync is not None else max(1, min(200, int(1e-3 / max(once, 1e-7))))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < budget_s and len(samples) < 200):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / loop)
    return {k: v * 1e3 for k, v in quantiles_ms(samples).items()}


def _backends(device: torch.device) -> list[tuple[str, str]]:
    """(backend, how) for every backend whose host route can be timed here."""
    from bik.runtime import cuda_jit

    if device.type == "cuda":
        found = [("triton", "host (synced)")]
        if cuda_jit.available():
            found.append(("cuda", "host (synced)"))
        return found
    found = [("cpu", "whole call")]
    if not torch.cuda.is_available():
        found.append(("triton", "dry run (sm_90, no launch)"))
    return found


def route_records(device: torch.device, quick: bool = False) -> list[dict]:
    """One record per (call, backend), and torch's call on ``device``."""
    budget_s = 0.05 if quick else 0.3
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    records = []
    for backend, how in _backends(device):
        dry = backend == "triton" and device.type == "cpu"
        context = contextlib.nullcontext(None)
        if dry:
            from bik.runtime.triton_dry_run import dry_run

            context = dry_run()
        with torch.no_grad(), context as run:
            for name, (call, _) in _calls(device, backend).items():
                us = _host_us(call, sync, budget_s)
                launches = None
                if run is not None:
                    before = run.count
                    call()
                    launches = run.count - before
                records.append({"table": "route", "call": name, "backend": backend, "how": how,
                                **us, "launches": launches, "noisy": us["p80"] > NOISY * us["p20"]})
    with torch.no_grad():
        for name, (_, stock) in _calls(device, "cpu" if device.type == "cpu" else "triton").items():
            us = _host_us(stock, sync, budget_s)
            records.append({"table": "route", "call": name, "backend": "torch (stock)",
                            "how": "host (synced)" if sync else "whole call", **us,
                            "launches": None, "noisy": us["p80"] > NOISY * us["p20"]})
    return records
