"""bik.enable() / disable() / enabled(): process-wide, every thread, exactly restorable."""

import threading
import warnings

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched, same_bits

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")


@pytest.fixture(autouse=True)
def _clean():
    bik.reset_mode_stats()
    yield
    bik.disable()


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "worker thread hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _linear_rows(w):
    return lambda x: F.linear(x, w)


def test_worker_thread_is_routed_and_stock_is_not_invariant_there(gen):
    """Measured negative control: stock fp32 CPU mm computes a row at M = 1 differently from
    M >= 4, in a worker thread as anywhere."""
    w = torch.randn(192, 256, generator=gen)
    pool = torch.randn(16, 256, generator=gen)
    check = lambda: rows_alone_vs_batched(_linear_rows(w), pool, (1, 4, 16))
    with torch.no_grad():
        assert not _in_thread(check).ok
        with bik.enabled():
            report = _in_thread(check)
            routed = bik.mode_stats().routed
    assert report.ok, report.summary()
    assert routed.get("aten.mm.default", 0) > 0


def test_enable_is_idempotent_and_disable_restores_stock(gen):
    a, b = torch.randn(1, 256, generator=gen), torch.randn(256, 192, generator=gen)
    stock = torch.mm(a, b)
    bik.enable()
    bik.enable()
    assert bik.is_enabled()
    assert same_bits(torch.mm(a, b), bik.matmul(a, b))
    bik.disable()
    bik.disable()
    assert not bik.is_enabled()
    bik.reset_mode_stats()
    assert same_bits(torch.mm(a, b), stock)
    assert not bik.mode_stats().routed  # the original kernel is back, nothing routed


def test_enabled_block_nests_inside_enable_and_restores_the_previous_state():
    bik.enable()
    with bik.enabled():
        pass
    assert bik.is_enabled()  # the block did not turn off what enable() turned on
    bik.disable()
    with pytest.raises(KeyError), bik.enabled():
        assert bik.is_enabled()
        raise KeyError("inside")
    assert not bik.is_enabled()


def test_flags_restored_after_disable():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with bik.enabled():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_routes_under_every_grad_context(ctx, gen):
    x, w = torch.randn(3, 5, 40, generator=gen), torch.randn(24, 40, generator=gen)
    with ctx(), bik.enabled():
        got = F.linear(x, w)
        s = F.softmax(got, -1)
        m = got.mean(-1)
    assert same_bits(got.detach(), bik.linear(x, w))
    assert same_bits(s.detach(), bik.softmax(got.detach(), -1))
    assert same_bits(m.detach(), bik.mean(got.detach(), -1))


def test_unserved_dtypes_compute_the_right_answer_and_are_counted(gen):
    d = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    i = torch.arange(12).reshape(3, 4)
    with bik.enabled():
        got_d = torch.mm(d, d.t())
        got_i = i.sum(0)
        got_s = torch.softmax(d, -1)
        fb = bik.mode_stats().fallbacks
    assert torch.equal(got_d, torch.mm(d, d.t()))
    assert torch.equal(got_i, torch.tensor([12, 15, 18, 21]))
    assert torch.equal(got_s, torch.softmax(d, -1))
    assert fb["aten.mm.default: dtype float64"] == 1
    assert fb["aten.sum.dim_IntList: dtype int64"] == 1


def test_out_variants_are_routed(gen):
    a, b = torch.randn(5, 40, generator=gen), torch.randn(40, 7, generator=gen)
    out = torch.empty(5, 7)
    with bik.enabled():
        torch.mm(a, b, out=out)
        r = bik.mode_stats().routed
    assert same_bits(out, bik.matmul(a, b)) and r["aten.mm.out"] == 1


def test_inside_the_mode_and_the_mode_inside(gen):
    a, b = torch.randn(2, 64, generator=gen), torch.randn(64, 16, generator=gen)
    want = bik.matmul(a, b)
    with bik.enabled(), bik.batch_invariant_mode():
        assert same_bits(a @ b, want)
    with bik.batch_invariant_mode(), bik.enabled():
        assert same_bits(a @ b, want)
    assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()


def test_exceptions_unwind_both_front_ends_in_either_order(gen):
    a, b = torch.randn(1, 64, generator=gen), torch.randn(64, 16, generator=gen)
    stock = torch.mm(a, b)
    for outer, inner in ((bik.enabled, bik.batch_invariant_mode),
                         (bik.batch_invariant_mode, bik.enabled)):
        with pytest.raises(RuntimeError, match="inside"), outer(), inner():
            raise RuntimeError("inside")
        assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()
        assert torch._C._len_torch_function_stack() == 0
        assert torch._C._len_torch_dispatch_stack() == 0
    bik.reset_mode_stats()
    assert same_bits(torch.mm(a, b), stock) and not bik.mode_stats().routed


def test_enable_from_several_threads_at_once(gen):
    """enable/disable race from many threads: ends enabled exactly once, then restores."""
    barrier = threading.Barrier(4)

    def flip():
        barrier.wait(timeout=30)
        for _ in range(5):
            bik.enable()
        return True

    threads = [threading.Thread(target=flip) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert bik.is_enabled()
    bik.disable()
    assert not bik.is_enabled()
    a = torch.randn(1, 64, generator=gen)
    bik.reset_mode_stats()
    a @ a.t()
    assert not bik.mode_stats().routed


def test_no_override_warning_leaks():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bik.enable()
        bik.disable()
