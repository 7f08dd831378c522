"""What one eager call costs the host on the GPU route, and the direct launch path under it.

Budgets, per call, for the ops a decode step makes (launches counted by name, aten ops the
call issues itself counted by tests/launch_count.py, no device-to-host read under
forbid_host_reads):

| call | launches | aten ops |
|---|---|---|
| bik.linear, M = 1 (SPREAD, folded by the last program) | matmul_kernel | t, 3 unsqueeze, 2 empty |
| bik.linear, M = 256 (FOLD) | matmul_kernel | t, 3 unsqueeze, 1 empty |
| bik.rms_norm (fused residual too) | rms_norm_kernel | 1 empty (2 fused) |
| bik.attention, decode, host metadata | attention_kernel | 4 empty |
| bik.sample, temperature only, host metadata | group_max, group_mass, gumbel_pick, finish | 4 empty |
| bik.grouped_matmul, 8 experts (dry run and GPU: the ends stay on the device) | grouped_matmul_kernel | 1 empty |

Routes: ``dry-run`` (this process, no GPU: Triton compiles for sm_90 and runs its host path,
the launch itself recorded instead of made: bik.runtime.triton_dry_run), ``interpreter`` and
``gpu-triton``. Each call is counted twice: the first goes through Triton's own launch path
(compile, bind), the second through bik's direct one (runtime/triton_launch.py), and both
counts must be the budget's (a direct path the counter missed would count 0).

The direct path hands the launcher exactly what Triton's own path hands it (dry run, argument
by argument), and a new specialisation (a tensor off 16-byte alignment, an int that becomes 1)
goes back through Triton's path.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import bik
import pytest
import torch
from bik._arch import interpreter_active
from bik.testing.host_reads import forbid_host_reads
from launch_count import count_calls

_NO_DRY_RUN = pytest.mark.skipif(interpreter_active() or torch.cuda.is_available(),
                                 reason="the dry run needs a process without the interpreter "
                                        "and without a GPU")
ROUTES = [
    pytest.param("dry-run", marks=[pytest.mark.cpu, _NO_DRY_RUN], id="dry-run"),
    pytest.param("interpreter", marks=[pytest.mark.interpreter, pytest.mark.skipif(
        not interpreter_active(), reason="needs TRITON_INTERPRET=1")], id="interpreter"),
    pytest.param("gpu-triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")], id="gpu-triton"),
]


@contextlib.contextmanager
def _route(route: str):
    """(device, the dry run's record or None) with the route's setting on."""
    if route == "dry-run":
        from bik.runtime.triton_dry_run import dry_run

        with dry_run() as run:
            yield "cpu", run
    else:
        yield ("cuda" if route == "gpu-triton" else "cpu"), None


def _decode_calls(device: str, small: bool) -> dict:
    """name -> (call, launches, aten ops) for the budget table above."""
    n, k = (64, 128) if small else (4096, 4096)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().to(device)
    x1 = torch.randn(1, k, generator=gen).bfloat16().to(device)
    x256 = torch.randn(256 if not small else 40, k, generator=gen).bfloat16().to(device)
    h = torch.randn(4, k, generator=gen).bfloat16().to(device)
    res, nw = h.clone(), torch.randn(k, generator=gen).bfloat16().to(device)
    b, hq, hkv, d, bs, keys = 4, 8, 2, (16 if small else 128), 16, (64 if small else 1024)
    kc = torch.randn(b * keys // bs, bs, hkv, d, generator=gen).bfloat16().to(device)
    q = torch.randn(b, hq, d, generator=gen).bfloat16().to(device)
    meta = {"cache_seqlens": torch.full((b,), keys, dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32, device=device),
            "block_table": torch.arange(b * keys // bs, dtype=torch.int32,
                                        device=device).view(b, -1),
            "max_seqlen_q": 1, "max_seqlen_k": keys}
    logits = torch.randn(4, 1000 if small else 128256, generator=gen).to(device)
    rows = {"seed": torch.arange(4) + 7, "position": torch.arange(4) + 40,
            "temperature": torch.full((4,), 0.8), "top_k": torch.zeros(4, dtype=torch.long),
            "top_p": torch.ones(4), "min_p": torch.zeros(4)}  # every row parameter a tensor
    rows = {k: v.to(device) for k, v in rows.items()}
    linear = Counter({"aten::t": 1, "aten::unsqueeze": 3})
    experts = torch.randn(8, n, k, generator=gen).bfloat16().to(device).transpose(1, 2)
    ends = torch.tensor([0, 3, 3, 9, 20, 20, 33, x256.shape[0]], dtype=torch.int32,
                        device=device)
    return {  # (the interpreter's K = 128 is one split: FOLD, no workspace)
        "linear-m1": (lambda: bik.linear(x1, w, backend="triton"), ["matmul_kernel"],
                      linear + Counter({"aten::empty": 1 + (not small)})),
        "linear-fold": (lambda: bik.linear(x256, w, backend="triton"), ["matmul_kernel"],
                        linear + Counter({"aten::empty": 1})),
        "norm": (lambda: bik.rms_norm(h, nw, 1e-6, backend="triton"), ["rms_norm_kernel"],
                     Counter({"aten::empty": 1})),
        "norm+residual": (lambda: bik.rms_norm(h, nw, 1e-6, residual=res,
                                                    backend="triton"),
                               ["rms_norm_kernel"], Counter({"aten::empty": 2})),
        "attention-decode": (lambda: bik.attention(q, kc, kc, **meta, backend="triton"),
                             ["attention_kernel"], Counter({"aten::empty": 4})),
        "sample": (lambda: bik.sample(logits, **rows, max_top_k=0, any_top_p=False,
                                      backend="triton"),
                   ["group_max_kernel", "group_mass_kernel", "gumbel_pick_kernel",
                    "finish_kernel"], Counter({"aten::empty": 4})),
        "grouped": (lambda: bik.grouped_matmul(x256, experts, ends, backend="triton"),
                    ["grouped_matmul_kernel"], Counter({"aten::empty": 1})),
    }


CALLS = ["linear-m1", "linear-fold", "norm", "norm+residual", "attention-decode", "sample",
         "grouped"]


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("route", ROUTES)
def test_a_decode_call_stays_within_its_launch_and_aten_budget(route, name):
    from bik.runtime import triton_launch

    if name == "grouped" and route == "interpreter":
        pytest.skip("on CPU tensors the grouped product checks its ends (a host read)")
    with _route(route) as (device, _):
        call, launches, aten = _decode_calls(device, route == "interpreter")[name]
        call()  # compiled, and the stream's ticket counters allocated (once per stream)
        triton_launch.clear()  # so the next launches take Triton's own path once more
        for attempt in ("first (Triton's path)", "again (the direct path)"):
            with forbid_host_reads(), count_calls() as calls:
                call()
            assert calls.launches == launches, (attempt, calls.launches)
            assert calls.aten == aten, (attempt, calls.aten)
            if calls.device_kernels is not None:  # a GPU: no kernel the hooks did not see
                assert len(calls.device_kernels) == len(launches), calls.device_kernels


# ---- the direct path itself (dry run) -------------------------------------------------------

def _jit_runs(monkeypatch) -> list:
    """The kernels Triton's own launch path (JITFunction.run) runs from now on."""
    from triton.runtime.jit import JITFunction

    runs, run = [], JITFunction.run

    def counted(self, *args, **kwargs):
        runs.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return runs


def _same(a, b) -> bool:
    """One launcher argument, handed over twice: a tensor or descriptor the same object, any
    other value of the same type and spelling (0.0 is not -0.0, 1 is not 1.0)."""
    if isinstance(a, torch.Tensor) or type(a).__name__ == "TensorDescriptor":
        return a is b
    return type(a) is type(b) and repr(a) == repr(b)


@_NO_DRY_RUN
@pytest.mark.cpu
@pytest.mark.parametrize("name", [*CALLS, "linear-persistent", "linear-bias"])
def test_the_direct_path_hands_the_launcher_what_tritons_path_does(name, monkeypatch):
    """Every launch of the call's second run takes the direct path, and is followed at once by
    Triton's own launch of the same kernel with the same arguments: the launcher is handed
    the same stream, kernel handle, packed metadata and arguments both times."""
    import sys

    from bik.runtime import triton_launch
    from bik.runtime.triton_dry_run import dry_run

    real, pairs, jit_runs = triton_launch.launch, [], _jit_runs(monkeypatch)

    def direct_then_triton(kernel, grid, *args, **kwargs):
        before = len(jit_runs)
        real(kernel, grid, *args, **kwargs)
        direct = run.launches[-1]
        took_direct = len(jit_runs) == before
        kernel[grid](*args, **kwargs)  # Triton's own path, the same arguments
        pairs.append((took_direct, direct, run.launches[-1]))

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("bik.ops.") and \
                getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", direct_then_triton)
    with dry_run(keep_args=True) as run:
        calls = {k: v[0] for k, v in _decode_calls("cpu", False).items()}
        w, x = torch.randn(4096, 4096).bfloat16(), torch.randn(1024, 4096).bfloat16()
        bias = torch.randn(4096).bfloat16()
        calls |= {"linear-persistent": lambda: bik.linear(x, w, backend="triton"),
                  "linear-bias": lambda: bik.linear(x[:1], w, bias, backend="triton")}
        calls[name]()  # compiled and bound
        pairs.clear()
        calls[name]()
    assert pairs and all(took_direct for took_direct, _, _ in pairs), pairs
    for _, direct, triton_path in pairs:
        assert (direct.name, direct.grid) == (triton_path.name, triton_path.grid)
        assert len(direct.args) == len(triton_path.args), direct.name
        assert all(map(_same, direct.args, triton_path.args)), direct.name
    if name == "linear-persistent":  # the TensorDescriptor path was covered
        assert pairs[0][1].name == "matmul_tma_kernel"


@_NO_DRY_RUN
@pytest.mark.cpu
def test_a_new_specialisation_goes_back_through_tritons_path(monkeypatch):
    """Triton compiles per specialisation (16-byte aligned pointers, ints equal to 1 or
    multiples of 16): the direct path keys on the same, so a change of either compiles and
    launches through Triton again, and the kernel it then launches directly is that one."""
    from bik.ops.rms_norm import triton as rms
    from bik.runtime.triton_dry_run import dry_run
    from bik.runtime.triton_launch import launch

    x = torch.randn(3, 65).bfloat16()
    w = torch.randn(64).bfloat16()
    out = torch.empty(3, 64, dtype=torch.bfloat16)

    def norm(x, hidden=64):
        launch(rms.rms_norm_kernel, (x.shape[0],), x, x, w, out, out, hidden, 1e-6,
               x.stride(0), 0, out.stride(0), 0, HAS_RESIDUAL=False, BLOCK_H=64, num_warps=4)

    with dry_run(keep_args=True) as run:
        aligned, shifted = x[:, :64], x[:, 1:]  # the second starts 2 bytes in
        norm(aligned)
        runs = _jit_runs(monkeypatch)
        norm(aligned)
        assert runs == []
        norm(shifted)
        assert runs == ["rms_norm_kernel"]
        norm(shifted)
        norm(aligned, hidden=1)  # an int that becomes 1 is a constexpr to Triton
        assert runs == ["rms_norm_kernel", "rms_norm_kernel"]
        handles = [launch.args[1] for launch in run.launches]
        # aligned, aligned, shifted (Triton), shifted (direct), hidden=1 (Triton)
        assert handles[0] == handles[1] and handles[2] == handles[3]
        assert len({handles[0], handles[2], handles[4]}) == 3


@_NO_DRY_RUN
@pytest.mark.cpu
def test_the_counter_would_see_a_direct_path_that_dropped_the_launch_hooks(monkeypatch):
    """Control for the budget test: launches are counted through Triton's launch hooks, which
    the direct path must hand on. One that dropped them would count 0 launches, not pass."""
    import triton
    from bik.runtime import triton_launch
    from bik.runtime.triton_dry_run import dry_run

    class NoHooks:  # what the direct path would see if it ignored the registered hooks
        class runtime:
            launch_enter_hook = launch_exit_hook = triton.knobs.HookChain()

    with dry_run():
        call, launches, _ = _decode_calls("cpu", False)["linear-m1"]
        call()  # compiled and bound
        monkeypatch.setattr(triton_launch, "knobs", NoHooks)
        with count_calls() as calls:
            call()
        assert calls.launches == [] and launches  # the budget test would fail on this


@pytest.mark.cpu
def test_zeroed_counters_are_one_buffer_per_thread_grown_zeroed():
    """The ticket buffer a single-launch fold takes (bik.runtime.counters): the same buffer
    for the same stream (here: thread), a new zeroed one when a call needs more, another
    thread's own."""
    import threading

    from bik.runtime.counters import zeroed_counters

    cpu = torch.device("cpu")
    first = zeroed_counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert zeroed_counters(cpu, 10) is first
    first[3] = 7  # a kernel that broke the contract: the next same-size call sees it
    assert zeroed_counters(cpu, 10)[3] == 7
    first[3] = 0
    bigger = zeroed_counters(cpu, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and not bigger.any()
    other = []
    thread = threading.Thread(target=lambda: other.append(zeroed_counters(cpu, 10)))
    thread.start()
    thread.join()
    assert other[0] is not bigger


@_NO_DRY_RUN
@pytest.mark.cpu
def test_calls_the_direct_path_cannot_key_take_tritons_path_every_time(monkeypatch):
    """A constexpr given positionally (Triton keys it by value, the direct path would key it
    by its specialisation: 64 and 128 alike) and a runtime argument given by name (keyed by
    value: 0.0 == -0.0) run through Triton's path on every call, so each gets Triton's kernel
    and Triton's arguments."""
    from bik.ops.rms_norm import triton as rms
    from bik.runtime.triton_dry_run import dry_run
    from bik.runtime.triton_launch import launch

    x, w = torch.randn(2, 128).bfloat16(), torch.randn(128).bfloat16()
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    runtime = (x, x, w, out, out, 128, 1e-6, 128, 0, 128, 0)
    with dry_run(keep_args=True) as run:
        runs = _jit_runs(monkeypatch)
        for block in (64, 128, 64):  # HAS_RESIDUAL and BLOCK_H positionally
            launch(rms.rms_norm_kernel, (2,), *runtime, False, block, num_warps=4)
        assert runs == ["rms_norm_kernel"] * 3
        assert run.launches[0].args[1] == run.launches[2].args[1] != run.launches[1].args[1]
        for eps in (0.0, -0.0):  # eps by name
            launch(rms.rms_norm_kernel, (2,), *runtime[:6], eps=eps, stride_x=128, stride_r=0,
                   stride_out=128, stride_h=0, HAS_RESIDUAL=False, BLOCK_H=128, num_warps=4)
        assert runs == ["rms_norm_kernel"] * 5
        assert [repr(launch.args[3 + 6]) for launch in run.launches[3:]] == ["0.0", "-0.0"]


@_NO_DRY_RUN
@pytest.mark.cpu
def test_the_dry_run_enters_and_leaves_with_dead_weak_proxies_on_the_heap():
    """The dry run forgets every live JITFunction's per-device cache by walking the heap, which
    holds weak proxies whose referents died (one asked for its class raises ReferenceError:
    found by a fresh-clone CI run)."""
    import weakref

    from bik.runtime.triton_dry_run import dry_run

    class Gone:
        pass

    gone = Gone()
    proxies = [weakref.proxy(gone)]
    del gone
    with pytest.raises(ReferenceError):
        isinstance(proxies[0], int)
    with dry_run():
        pass
