"""bik's boolean environment variables go through one parser (bik._env.flag, issue 50): every
spelling of on and off is read as such, anything else is an error naming the variable, and no
module reads a boolean BIK_* variable by hand. Measured before: BIK_ENABLE_NATIVE=false kept the
C++ kernels on and BIK_DEBUG_CHECKS=false turned the checks on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from bik._env import flag

ROOT = Path(__file__).resolve().parents[1]
# The BIK_* variables that are not booleans (paths, choices), read as strings.
NOT_BOOLEAN = {"BIK_NATIVE_CACHE", "BIK_CUDA_CACHE", "BIK_CACHE_DIR", "BIK_BUILD_CACHE",
               "BIK_CPU_BF16", "BIK_CPU_FP32", "BIK_MATMUL_SPLIT", "BIK_MOE_EXPERTS",
               "BIK_VLLM_DRAFT_KERNELS"}


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), ("Yes", True),
                                         ("ON", True), (" on ", True), ("0", False),
                                         ("false", False), ("No", False), ("off", False)])
def test_every_spelling_of_on_and_off(monkeypatch, value, want):
    monkeypatch.setenv("BIK_SOME_FLAG", value)
    assert flag("BIK_SOME_FLAG") is want and flag("BIK_SOME_FLAG", True) is want


def test_unset_or_empty_is_the_default_and_anything_else_is_refused(monkeypatch):
    monkeypatch.delenv("BIK_SOME_FLAG", raising=False)
    assert flag("BIK_SOME_FLAG") is False and flag("BIK_SOME_FLAG", True) is True
    monkeypatch.setenv("BIK_SOME_FLAG", "")
    assert flag("BIK_SOME_FLAG", True) is True
    monkeypatch.setenv("BIK_SOME_FLAG", "enabled")
    with pytest.raises(ValueError, match="BIK_SOME_FLAG='enabled' is not a boolean"):
        flag("BIK_SOME_FLAG")


def _child(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], env=os.environ | env, text=True,
                          capture_output=True, timeout=300, check=False)


def test_false_turns_the_native_kernels_and_the_debug_checks_off():
    got = _child("import bik; from bik.ops import _native, _checks; "
                 "print(_native.ready(), _checks.debug_checks())",
                 BIK_ENABLE_NATIVE="false", BIK_DEBUG_CHECKS="false")
    assert got.returncode == 0 and got.stdout.split() == ["False", "False"], got.stderr[-2000:]
    got = _child("import bik", BIK_DEBUG_CHECKS="maybe")
    assert got.returncode != 0 and "BIK_DEBUG_CHECKS='maybe' is not a boolean" in got.stderr


def test_no_module_reads_a_boolean_bik_variable_by_hand():
    """Every os.environ read of a BIK_* variable in the package and setup.py is of a variable
    that is not a boolean; the booleans are flag()'s."""
    read = re.compile(r"""os\.environ(?:\.get\(\s*["'](BIK_[A-Z0-9_]+)["']"""
                      r"""|\[\s*["'](BIK_[A-Z0-9_]+)["']\s*\](?!\s*=[^=]))""")  # not a write
    sources = [*sorted((ROOT / "python" / "bik").rglob("*.py")), ROOT / "setup.py"]
    by_hand = {(path.relative_to(ROOT).as_posix(), name) for path in sources
               for got in read.findall(path.read_text()) for name in got
               if name and name not in NOT_BOOLEAN}
    assert not by_hand, f"boolean BIK_* variables read without bik._env.flag: {sorted(by_hand)}"
