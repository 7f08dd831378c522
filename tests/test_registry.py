"""The (op, backend) table (bik/ops/_registry.py) is the whole truth about what runs where.

* every ``bik::`` op registered with torch has a row, and every row is registered;
* every listed (op, backend) pair names a module that defines the row's entry point;
* every unlisted pair raises BackendUnavailableError naming the op and the backends it has,
  through the public function and the registered op alike (nothing falls back silently);
* every op either has a backward whose gradients match fp64 autograd within measured bounds
  (one case per op in tests/op_cases.py) or raises NotImplementedError naming the op;
* the public functions' ``backend:`` docstring lines and the fingerprint's op list come from
  the table.
"""

from __future__ import annotations

import importlib
import inspect

import bik
import pytest
import torch
from bik.ops._define import DECLARED
from bik.ops._registry import BACKENDS, TABLE, BackendUnavailableError, backend_doc
from bik.runtime import cpu_ext
from op_cases import CASES

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

CPU = torch.device("cpu")
WITH_BACKEND = [op for op, row in TABLE.items() if row.backends]


def test_every_registered_op_has_a_row_and_every_row_is_registered():
    registered = {name.removeprefix("bik::") for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("bik::")}
    assert registered == set(TABLE)


def test_every_op_is_declared_once_with_its_schema():
    """ops/_define.py's record is what the route chooser reads: one per row, its argument names
    the registered schema's."""
    assert set(DECLARED) == set(TABLE)
    for op, decl in DECLARED.items():
        schema = getattr(torch.ops.bik, op).default._schema
        assert decl.arguments == tuple(a.name for a in schema.arguments), op
        assert (decl.backend_at is None) == (not TABLE[op].backends), op


def _signature(fn) -> tuple[tuple, dict]:
    """(the positional parameters and the required keyword-only ones, {optional keyword-only
    parameter: its default})."""
    params = inspect.signature(fn).parameters.values()
    required = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                     p.POSITIONAL_OR_KEYWORD) or (p.kind == p.KEYWORD_ONLY
                                                  and p.default is p.empty))
    optional = {p.name: p.default for p in params
                if p.kind == p.KEYWORD_ONLY and p.default is not p.empty}
    return required, optional


@pytest.mark.parametrize("op", WITH_BACKEND)
def test_every_listed_pair_has_its_entry_point(op):
    """Each backend's entry takes the same required arguments (the op's comment in op.py
    declares them); optional keyword-only knobs (a layer's tables, a split, speed) default to
    None."""
    row = TABLE[op]
    assert set(row.backends) <= set(BACKENDS)
    signatures = {}
    for backend, module in row.backends.items():
        entry = getattr(importlib.import_module(module), row.entry, None)
        assert callable(entry), f"{module}.{row.entry} ({op}, {backend})"
        required, optional = _signature(entry)
        signatures[backend] = required
        assert all(default is None for default in optional.values()), \
            f"{module}.{row.entry}: optional keywords {optional} must default to None"
    assert len(set(signatures.values())) == 1, signatures


def test_the_signature_check_sees_a_mismatch():
    def launch_a(x, out, *, log, split=None):
        pass

    def launch_b(x, out, log):
        pass

    assert _signature(launch_a) == (("x", "out", "log"), {"split": None})
    assert _signature(launch_b)[0] == ("x", "out", "log")
    assert _signature(lambda x, out, *, log=False: None)[1] == {"log": False}


@pytest.mark.parametrize("op", WITH_BACKEND)
def test_every_unlisted_pair_raises_naming_the_op_and_its_backends(op):
    from bik.ops._registry import require_backend

    have = TABLE[op].backends
    for backend in set(BACKENDS) - set(have):
        with pytest.raises(BackendUnavailableError) as err:
            require_backend(op, backend, CPU)
        assert f"bik.{op}: backend={backend!r} does not implement" in str(err.value)
        assert all(repr(b) in str(err.value) for b in have)


X = torch.randn(3, 5)


@pytest.mark.parametrize("call", [
    lambda: bik.softmax(X, backend="cuda"),
    lambda: bik.log_softmax(X, backend="cuda"),
    lambda: bik.mean(X, 1, backend="cuda"),
    lambda: torch.ops.bik.softmax(X, -1, None, "cuda"),
    lambda: torch.ops.bik.log_softmax(X, -1, None, "cuda"),
    lambda: torch.ops.bik.mean(X, [1], False, None, "cuda"),
], ids=["softmax", "log_softmax", "mean", "op-softmax", "op-log_softmax", "op-mean"])
def test_reductions_on_cuda_raise_instead_of_running_triton(call):
    # The old ladder's last arm ran Triton for any backend it did not know.
    with pytest.raises(BackendUnavailableError, match=r"backend='cuda' does not implement .* "
                                                      r"'triton', 'cpu'"):
        call()


def test_docstrings_take_their_backend_line_from_the_table():
    for fn, op in ((bik.matmul, "matmul"), (bik.linear, "matmul"), (bik.bmm, "bmm"),
                   (bik.rms_norm, "rms_norm"), (bik.softmax, "softmax"), (bik.mean, "mean"),
                   (bik.attention, "attention"), (bik.attention_varlen, "attention_varlen"),
                   (bik.sample, "sample"), (bik.verify_draft, "verify_draft")):
        assert "{backends}" not in fn.__doc__
        assert f"backend: {backend_doc(op)}" in " ".join(fn.__doc__.split()), fn.__name__
    assert '"cuda"' not in backend_doc("softmax") and '"cuda"' in backend_doc("matmul")


def test_fingerprint_lists_the_ops_of_the_table():
    fp = bik.fingerprint("cpu")
    assert set(fp.backends) == set(WITH_BACKEND)
    assert all(v == "cpu" for v in fp.backends.values())


# ---- gradient status ------------------------------------------------------------------------
# One case per op (tests/op_cases.py): (inputs, bik call, fp64 reference or None: a refusal).
# Accuracy: bik's normalised max error against fp64 autograd may be at most RATIO x stock
# torch's fp32 error, or FLOOR x eps. Measured (CPU, these cases): bik 0.24-2.7 eps, stock
# 0.24-4.8 eps; the worst ratio 1.8x (log_softmax: 0.92 vs 0.52 eps).
RATIO, FLOOR = 4.0, 2.0


GRADIENTS = {op: case.grad for op, case in CASES.items()}  # tests/op_cases.py


def test_every_op_has_a_gradient_case():
    assert set(GRADIENTS) == set(TABLE)
    for op, (_, _, reference) in GRADIENTS.items():
        assert (reference is not None) == TABLE[op].backward, op


def _leaves(tensors, dtype=None):
    return [t.to(dtype or t.dtype).detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("op", [op for op, row in TABLE.items() if row.backward])
def test_backward_matches_fp64_autograd(op):
    make, run, reference = GRADIENTS[op]
    inputs = make(torch.Generator().manual_seed(7))
    out = run(*_leaves(inputs))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    grads = {}
    for name, fn, dtype in (("bik", run, None), ("stock", reference, None),
                            ("fp64", reference, torch.float64)):
        leaves = _leaves(inputs, dtype)
        fn(*leaves).backward(upstream.to(dtype or upstream.dtype))
        grads[name] = [t.grad for t in leaves]
    eps = torch.finfo(torch.float32).eps
    for i, (g, s, r) in enumerate(zip(grads["bik"], grads["stock"], grads["fp64"])):
        assert g is not None and g.dtype == inputs[i].dtype, (op, i)
        scale = r.abs().max().clamp_min(1e-30)
        err = ((g.double() - r).abs().max() / scale).item()
        err_stock = ((s.double() - r).abs().max() / scale).item()
        assert err <= max(RATIO * err_stock, FLOOR * eps), (op, i, err, err_stock)


@pytest.mark.parametrize("op", [op for op, row in TABLE.items()
                                if not row.backward and row.backends])
def test_refused_backward_raises_naming_the_op(op):
    make, run, _ = GRADIENTS[op]
    out = run(*_leaves(make(torch.Generator().manual_seed(7))))
    with pytest.raises(NotImplementedError, match=rf"bik\.{op}: backward is not implemented"):
        out.sum().backward()


def test_the_issue_repro_now_gets_gradients():
    x = torch.randn(2, 5, requires_grad=True)
    bik.log_softmax(x, -1)[:, 0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
