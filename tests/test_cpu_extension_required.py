"""Without the CPU extension, everything whose CPU bits are bik's raises; nothing falls back to
torch's kernels, whose bits are not the contract's (bik/ops/_pointwise.py says why for exp).

The extension is masked in this process only (monkeypatch of bik.runtime.cpu_ext's loaded
module): every caller asks cpu_ext.available() / require() at call time.
"""

from __future__ import annotations

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.ops import _pointwise
from bik.ops._registry import TABLE
from bik.runtime import cpu_ext
from op_cases import CASES

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

BUILD_HINT = r"bik\._cpu_kernels.*not built.*C\+\+17 compiler"


@pytest.fixture
def no_extension(monkeypatch):
    monkeypatch.setattr(cpu_ext, "_ext", None)
    monkeypatch.setattr(cpu_ext, "_IMPORT_ERROR", "ImportError: masked by the test")


X = torch.randn(3, 8)
# One call per op of the (op, backend) table that has a CPU backend: tests/op_cases.py.
OP_CALLS = {op: case.call for op, case in CASES.items() if case.call is not None}

# bik's exp inside its ops, and a front end's route to an op.
OTHER_CALLS = {
    "exp_f32": lambda: _pointwise.exp_f32(X),
    "exp2_f32": lambda: _pointwise.exp2_f32(X),
    "unary_f32": lambda: _pointwise.unary_f32("log2", X.abs()),
    "mode matmul": lambda: _under_mode(torch.mm, X, torch.randn(8, 4)),
}


def _under_mode(fn, *args):
    with bik.batch_invariant_mode():
        return fn(*args)


def test_every_op_with_a_cpu_backend_has_a_call():
    assert set(OP_CALLS) == {op for op, row in TABLE.items() if "cpu" in row.backends}


@pytest.mark.parametrize("name", sorted(OP_CALLS) + sorted(OTHER_CALLS))
def test_raises_with_the_build_hint(name, no_extension):
    call = OP_CALLS.get(name) or OTHER_CALLS[name]
    with pytest.raises(RuntimeError, match=BUILD_HINT):
        call()


@pytest.mark.parametrize("name", sorted(OP_CALLS) + sorted(OTHER_CALLS))
def test_each_call_runs_with_the_extension(name):
    """The calls above are valid: what raises under the mask is the missing extension."""
    (OP_CALLS.get(name) or OTHER_CALLS[name])()


def test_silu_is_torch_ops_and_needs_no_extension(no_extension):
    """silu_f32 is torch.exp and correctly rounded ops by design (bik/ops/_pointwise.py):
    autograd differentiates it and torch.compile traces it."""
    from bik.dvr.model import swiglu

    torch.testing.assert_close(_pointwise.silu_f32(X), F.silu(X))
    torch.testing.assert_close(swiglu(torch.cat([X, X], 1)), F.silu(X) * X)
