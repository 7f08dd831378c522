"""bik.enable()'s C++ kernels for aten::mm / addmm / bmm at the CPU key
(csrc/native/native_cpu.cpp).

They must give the Python kernels' bits on every call they serve, hand every other call to the
Python kernel (same result, same errors, counted there), and leave the dispatcher exactly as
they found it.
"""

import os
import subprocess
import sys
import textwrap

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import native_ext, cpu_ext
from bik.testing import rows_alone_vs_batched, same_bits
from bik.testing.controls import split_by_m_matmul

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")
needs_native = pytest.mark.skipif(not native_ext.available(),
                                  reason=f"no C++ kernels: {native_ext.unavailable_reason()}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _clean():
    bik.disable()
    bik.reset_mode_stats()
    yield
    bik.disable()


def _native_served() -> int:
    return sum(torch.ops.bik_native.served())


def _run(call, *, native: bool):
    """(result, served by C++, routed or fallen back in Python) of ``call()`` under enable()."""
    os.environ["BIK_ENABLE_NATIVE"] = "1" if native else "0"
    try:
        bik.reset_mode_stats()
        before = _native_served()
        with bik.enabled():
            out = call()
        stats = bik.mode_stats()
        return out, _native_served() - before, stats
    finally:
        del os.environ["BIK_ENABLE_NATIVE"]


def _operands(gen, dtype, layout):
    a = torch.randn(5, 70, generator=gen).to(dtype)
    b = torch.randn(70, 33, generator=gen).to(dtype)
    if layout == "b = w.t()":
        b = torch.randn(33, 70, generator=gen).to(dtype).t()
    elif layout == "strided rows":
        a = torch.randn(10, 140, generator=gen).to(dtype)[::2, ::2]
    elif layout == "one row":
        a = a[:1]
    return a, b


SERVED = {
    "mm": lambda a, b, bias: torch.mm(a, b),
    "addmm bias [N]": lambda a, b, bias: torch.addmm(bias, a, b),
    "addmm bias [1, N]": lambda a, b, bias: torch.addmm(bias.unsqueeze(0), a, b),
    "linear 3-D input": lambda a, b, bias: F.linear(a.unsqueeze(0).expand(2, -1, -1), b.t(), bias),
    "bmm": lambda a, b, bias: torch.bmm(a.expand(3, -1, -1), b.unsqueeze(0).expand(3, -1, -1)),
}


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "b = w.t()", "strided rows", "one row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SERVED))
def test_native_kernels_give_the_python_kernels_bits(name, dtype, layout, gen):
    a, b = _operands(gen, dtype, layout)
    bias = torch.randn(b.shape[1], generator=gen).to(dtype)
    call = lambda: SERVED[name](a, b, bias)
    native, served, _ = _run(call, native=True)
    python, python_served, stats = _run(call, native=False)
    assert served >= 1 and python_served == 0  # each route was the one that ran
    assert stats.routed and not stats.fallbacks
    assert native.dtype == python.dtype == dtype and native.shape == python.shape
    assert same_bits(native, python)


ROW_OPS = {  # aten op -> a call of it as transformers' Llama makes it
    "aten.silu.default": F.silu,
    "aten.mean.dim": lambda x: x.float().pow(2).mean(-1, keepdim=True),  # LlamaRMSNorm
    "aten._softmax.default": lambda x: torch.softmax(x, dim=-1),  # eager attention
}


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "column slice", "transposed", "one row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_native_row_ops_give_the_python_kernels_bits(name, dtype, layout, gen):
    """aten::silu, mean.dim (last dim) and _softmax (last dim)'s C++ kernels: bik's silu (x /
    (1 + exp(-x)) in fp32, op for op) and the mean / softmax launchers' kernels on the same fp32
    rows, at widths that meet the SIMD body and its tail (3001, 1500), on the layouts vLLM and
    transformers hand over."""
    x = (6 * torch.randn(7, 3001, generator=gen)).to(dtype)
    # special values in a row of their own (a NaN poisons a softmax or mean row)
    x[3, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -90.0])
    x = {"contiguous": x, "column slice": x[:, :1500], "transposed": x.t(),
         "one row": x[:1]}[layout]
    call = ROW_OPS[name]
    native, served, _ = _run(lambda: call(x), native=True)
    python, python_served, stats = _run(lambda: call(x), native=False)
    assert served == 1 and python_served == 0
    assert stats.routed == {name: 1} and not stats.fallbacks
    assert same_bits(native, python)


@needs_native
def test_native_row_ops_hand_other_calls_to_python(gen):
    """A mean over another dim, a dtype= mean and half_to_float go to the Python kernel (which
    serves them or keeps aten's), with its bits."""
    x = torch.randn(4, 6, 5, generator=gen)
    for call in (lambda: x.mean(1), lambda: x.mean((1, 2)), lambda: x.mean(-1, dtype=torch.float32),
                 lambda: torch.softmax(x, 1), lambda: torch.ops.aten._softmax(x.half(), -1, True)):
        native, served, _ = _run(call, native=True)
        python, _, _ = _run(call, native=False)
        assert served == 0 and same_bits(native, python)


PUBLIC = {
    "bik.matmul": lambda a, b, bias: bik.matmul(a, b, bias),
    "bik.linear 3-D input": lambda a, b, bias: bik.linear(a.unsqueeze(0).expand(2, -1, -1), b.t()),
    "bik.bmm": lambda a, b, bias: bik.bmm(a.expand(3, -1, -1), b.unsqueeze(0).expand(3, -1, -1)),
}


def _python_launchers_refuse(monkeypatch):
    """The CPU backend's Python launchers raise: a call that reaches one did not go native."""
    from bik.ops.matmul import cpu

    def refuse(*args, **kwargs):
        raise AssertionError("the Python launcher ran")

    monkeypatch.setattr(cpu, "launch_matmul", refuse)  # bik::matmul's entry
    monkeypatch.setattr(cpu, "launch_bmm", refuse)  # bik::bmm's


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(PUBLIC))
def test_loaded_kernels_serve_the_public_functions_direct_route(name, dtype, gen, monkeypatch):
    """Once the C++ kernels are loaded (bik.enable() loads them), bik.matmul / linear / bmm's
    direct route runs them after the op's check instead of the Python launcher: the same bits,
    with BIK_ENABLE_NATIVE=0 the Python launcher again (the spy shows each route ran)."""
    from bik.ops import _native as native

    assert native.ready()  # loads them
    a, b = _operands(gen, dtype, "b = w.t()")
    bias = torch.randn(b.shape[1], generator=gen).to(dtype)
    with torch.no_grad():
        monkeypatch.setenv("BIK_ENABLE_NATIVE", "0")
        python = PUBLIC[name](a, b, bias)
        monkeypatch.setenv("BIK_ENABLE_NATIVE", "1")
        with monkeypatch.context() as patched:
            _python_launchers_refuse(patched)
            got = PUBLIC[name](a, b, bias)
            patched.setenv("BIK_ENABLE_NATIVE", "0")
            with pytest.raises(AssertionError, match="Python launcher ran"):
                PUBLIC[name](a, b, bias)
    assert same_bits(got, python)
    with pytest.raises(ValueError, match="bik.matmul"):  # the op's own check ran first
        bik.matmul(a, b[:-1])


@needs_native
def test_the_direct_route_leaves_the_loaded_kernels_when_they_would_differ(gen, monkeypatch):
    """The kernels keep the split rule they loaded with: under another rule, and with the CPU
    extension masked, a direct call goes to the Python launcher (the rule's bits; the build
    hint), as the spy shows."""
    from bik.ops import _native as native
    from bik.runtime import cpu_ext

    assert native.ready()
    a, b = torch.randn(3, 3000, generator=gen), torch.randn(3000, 5, generator=gen)
    with torch.no_grad():
        loaded = bik.matmul(a, b)
        monkeypatch.setenv("BIK_MATMUL_SPLIT", "none")
        with monkeypatch.context() as patched:
            _python_launchers_refuse(patched)
            with pytest.raises(AssertionError, match="Python launcher ran"):
                bik.matmul(a, b)
        unsplit = bik.matmul(a, b)
        monkeypatch.delenv("BIK_MATMUL_SPLIT")
        assert same_bits(bik.matmul(a, b), loaded)
        with monkeypatch.context() as masked:
            masked.setattr(cpu_ext, "_ext", None)
            masked.setattr(cpu_ext, "_IMPORT_ERROR", "ImportError: masked by the test")
            with pytest.raises(RuntimeError, match="not built"):
                bik.matmul(a, b)
    assert not same_bits(unsplit, loaded)  # K = 3000: two splits vs one, other bits


@needs_native
def test_native_counts_join_mode_stats_and_reset_with_them(gen):
    a, b = torch.randn(2, 8, generator=gen), torch.randn(8, 4, generator=gen)
    _, served, stats = _run(lambda: (torch.mm(a, b), torch.mm(a, b)), native=True)
    assert served == 2 and stats.routed == {"aten.mm.default": 2}
    bik.reset_mode_stats()
    assert not bik.mode_stats().routed and _native_served() == 0


DECLINED = {  # calls the C++ kernels leave to the Python kernel: (call, torch raises)
    "addmm alpha=2": (lambda a, b, x: torch.addmm(x[0], a, b, alpha=2), False),
    "addmm beta=0.5": (lambda a, b, x: torch.addmm(x[0], a, b, beta=0.5), False),
    "addmm bias [M, N]": (lambda a, b, x: torch.addmm(x[1], a, b), False),
    "mm int64": (lambda a, b, x: torch.mm(a.long(), b.long()), False),
    "mm fp64": (lambda a, b, x: torch.mm(a.double(), b.double()), False),
    "mm no rows": (lambda a, b, x: torch.mm(a[:0], b), False),
    "mm K = 0": (lambda a, b, x: torch.mm(a[:, :0], b[:0]), False),
    "mm mixed dtypes": (lambda a, b, x: torch.mm(a, b.bfloat16()), True),
    "mm shapes": (lambda a, b, x: torch.mm(a, b[:3]), True),
    "bmm batch sizes": (lambda a, b, x: torch.bmm(a.expand(2, -1, -1), b.expand(3, -1, -1)),
                        True),
    "addmm bias that does not broadcast": (lambda a, b, x: torch.addmm(x[0][:2], a, b), True),
}


@needs_native
@pytest.mark.parametrize("name", list(DECLINED))
def test_declined_calls_get_the_python_kernels_result_or_torchs_error(name, gen):
    a, b = torch.randn(3, 6, generator=gen), torch.randn(6, 4, generator=gen)
    extra = (torch.randn(4, generator=gen), torch.randn(3, 4, generator=gen))
    fn, raises = DECLINED[name]
    call = lambda: fn(a, b, extra)
    if raises:
        with pytest.raises(Exception) as stock_error:
            call()
        with bik.enabled(), pytest.raises(type(stock_error.value)) as error:
            call()
        assert str(error.value) == str(stock_error.value)
        assert _native_served() == 0
        return
    native, served, native_stats = _run(call, native=True)
    python, _, python_stats = _run(call, native=False)
    assert served == 0
    assert native_stats == python_stats  # the same routed / fallback counts, from Python
    assert same_bits(native, python)


def _linear_rows_check_failing_its_controls(gen):
    """(w, check): check(f) compares f's rows alone and batched over a pool of rows, and fails
    here for the stock product and a split-by-M reference (both measured, under no_grad)."""
    w = torch.randn(192, 256, generator=gen)
    pool = torch.randn(16, 256, generator=gen)
    check = lambda f: rows_alone_vs_batched(f, pool, (1, 4, 16))
    with torch.no_grad():
        assert not check(lambda x: F.linear(x, w)).ok  # stock, measured here
        assert not check(lambda x: split_by_m_matmul(x, w.t())).ok
    return w, check


@needs_native
def test_native_route_is_batch_invariant_where_stock_and_a_split_by_m_reference_fail(gen):
    w, check = _linear_rows_check_failing_its_controls(gen)
    with torch.no_grad():
        before = _native_served()
        with bik.enabled():
            report = check(lambda x: F.linear(x, w))
        assert _native_served() > before
    assert report.ok, report.summary()


@needs_native
def test_direct_route_on_loaded_kernels_is_batch_invariant_where_controls_fail(gen, monkeypatch):
    """bik.linear's direct route once the kernels are loaded (the Python launcher refused, so
    every call below ran the C++ kernel): rows alone = rows batched, with the stock product and
    a split-by-M reference failing the same check here."""
    from bik.ops import _native as native

    assert native.ready()
    w, check = _linear_rows_check_failing_its_controls(gen)
    with torch.no_grad():
        _python_launchers_refuse(monkeypatch)
        report = check(lambda x: bik.linear(x, w))
    assert report.ok, report.summary()


@needs_native
def test_disable_restores_the_dispatch_tables_exactly():
    names = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mm.out")
    before = {n: torch._C._dispatch_dump_table(n) for n in names}
    with bik.enabled():
        assert torch._C._dispatch_dump_table("aten::mm") != before["aten::mm"]
    with bik.enabled():  # twice: the second install must find a clean table too
        pass
    assert {n: torch._C._dispatch_dump_table(n) for n in names} == before


def _run_script(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          check=False, timeout=300)


@needs_native
def test_a_kernel_hand_over_that_fails_warns_and_keeps_the_python_route():
    """A loaded library whose C ABI does not match this bik._cpu_kernels (an older build)."""
    done = _run_script("""
        import warnings, torch, bik
        from bik.runtime import cpu_ext
        ext = cpu_ext.require()
        entries = ext.c_entry_points()
        ext.c_entry_points = lambda: {**entries, "abi_version": entries["abi_version"] + 1}
        a, b = torch.randn(2, 8), torch.randn(8, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # the failure is remembered, not retried
                with bik.enabled():
                    assert torch.equal(torch.mm(a, b), bik.matmul(a, b))
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(messages) == 1 and "C ABI" in messages[0], messages
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@needs_native
def test_the_compiled_ops_refuse_to_run_before_the_kernel_is_handed_over():
    """Loading the library alone (a public call) must not leave a null kernel to call: it
    was a segfault."""
    done = _run_script("""
        import torch
        from bik.runtime import native_ext
        assert native_ext.load()
        try:
            torch.ops.bik_native.matmul(torch.randn(2, 3), torch.randn(3, 4), None, None)
        except RuntimeError as exc:
            assert "not handed over" in str(exc), exc
            print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode,
                                                                  done.stderr[-3000:])


def test_a_failed_build_warns_and_keeps_the_python_route(tmp_path):
    """No compiler (CXX=false) and an empty cache: enable() still routes, through Python."""
    script = textwrap.dedent("""
        import warnings, torch, bik
        a, b = torch.randn(2, 8), torch.randn(8, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with bik.enabled():
                out = torch.mm(a, b)
        assert torch.equal(out, bik.matmul(a, b))
        assert bik.mode_stats().routed == {"aten.mm.default": 1}, bik.mode_stats()
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert any("dispatcher kernels (mm" in m and "false failed" in m for m in messages), messages
        print("ok")
    """)
    env = dict(os.environ, CXX="false", BIK_NATIVE_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=False,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_build_key_names_no_location(monkeypatch):
    """Another clone or venv with the same sources and torch meets the same build: the key holds
    the sources' hash, the torch version and the command with its directories as placeholders;
    a change of source or torch version is another build."""
    material = native_ext.key_material()
    assert str(native_ext._PKG.parents[1]) not in material and sys.prefix not in material
    assert native_ext.source_hash() in material and torch.__version__ in material
    assert "<torch>/include" in material and "<source>/native_cpu.cpp" in material
    before = native_ext.library_path()
    monkeypatch.setattr(native_ext, "source_hash", lambda: "edited")
    assert native_ext.library_path() != before


@needs_native
def test_the_direct_route_calls_the_loaded_librarys_python_functions(gen):
    """The direct route's native entry is the loaded library's own Python function (no
    dispatcher around the product): bik::matmul's bits, and a call the C++ kernel does not serve
    goes to bik::matmul, whose error keeps its type and names the op."""
    from bik.ops import _native as native

    assert native.ready()
    module = native_ext.module()
    from bik.ops._define import DECLARED

    assert DECLARED["matmul"].native(loaded_only=True) is module.matmul
    assert DECLARED["bmm"].native(loaded_only=True) is module.bmm
    a, b = torch.randn(3, 70, generator=gen), torch.randn(70, 5, generator=gen)
    with torch.no_grad():
        assert same_bits(module.matmul(a, b, None, None), torch.ops.bik.matmul(a, b, None, None,
                                                                              "cpu"))
        assert same_bits(module.bmm(a[None], b[None], None), torch.ops.bik.bmm(a[None], b[None],
                                                                              None, "cpu"))
    with pytest.raises(TypeError, match="bik.matmul: a has dtype float64"):
        module.matmul(a.double(), b.double(), None, None)
