"""bik.fingerprint(): stable for unchanged inputs, changed by any config-table change."""

import dataclasses
import importlib

import bik
import pytest
import torch
from bik import configs


def test_fingerprint_is_stable_and_complete():
    a, b = bik.fingerprint("cpu"), bik.fingerprint(torch.device("cpu"))
    assert a == b
    assert a.arch in ("cpu", "interpreter")
    assert set(a.backends) >= {"matmul", "bmm", "rms_norm", "fused_add_rms_norm", "softmax",
                               "log_softmax", "mean"}
    assert {"bik", "torch", "triton"} <= set(a.versions)
    assert len(a.digest) == 16


def test_config_change_changes_fingerprint(monkeypatch):
    before = bik.fingerprint("cpu")
    table = {arch: dict(row) for arch, row in configs._MATMUL_BASE.items()}
    table["sm90"]["bf16"] = dataclasses.replace(table["sm90"]["bf16"], block_k=32)
    monkeypatch.setattr(configs, "_MATMUL_BASE", table)
    after = bik.fingerprint("cpu")
    assert after.config_hash != before.config_hash and after.digest != before.digest


def test_rms_norm_table_change_changes_fingerprint(monkeypatch):
    before = bik.fingerprint("cpu")
    monkeypatch.setitem(configs._RMS_NORM_MAX_BLOCK, "sm90", 2048)
    assert bik.fingerprint("cpu").digest != before.digest


def test_configs_never_see_m():
    """The config functions have no M parameter: the batch cannot pick a tile."""
    import inspect

    assert list(inspect.signature(configs.matmul_config).parameters) == ["dtype", "n", "k", "arch"]
    assert list(inspect.signature(configs.rms_norm_config).parameters) == ["dtype", "hidden",
                                                                           "arch"]


def test_every_kernel_and_op_source_is_hashed():
    fp_mod = importlib.import_module("bik.fingerprint")  # bik.fingerprint is the function

    hashed = {p.relative_to(fp_mod._PKG).as_posix() for p in fp_mod.numeric_sources()}
    pkg = fp_mod._PKG
    expected = {p.relative_to(pkg).as_posix() for p in
                [*pkg.glob("ops/*/*.py"), *pkg.glob("ops/*.py"), *pkg.glob("runtime/*.py"),
                 pkg / "configs.py", pkg / "_dtypes.py", pkg / "_arch.py"]
                if p.name != "reference.py"}  # the contract for tests: runs no kernel
    assert expected <= hashed
    assert not any(p.endswith("reference.py") for p in hashed)


def test_source_change_changes_fingerprint(monkeypatch, tmp_path):
    fp_mod = importlib.import_module("bik.fingerprint")  # bik.fingerprint is the function

    src = tmp_path / "kernel.py"
    src.write_text("BLOCK = 64\n")
    monkeypatch.setattr(fp_mod, "numeric_sources", lambda: [src])
    monkeypatch.setattr(fp_mod, "_PKG", tmp_path)
    before = bik.fingerprint("cpu").digest
    src.write_text("BLOCK = 32\n")
    assert bik.fingerprint("cpu").digest != before


def test_cpu_extension_carries_its_source_hash():
    from bik.runtime import cpu_ext

    if cpu_ext.available():
        assert cpu_ext.source_hash() not in (None, "unknown")


def test_a_device_it_cannot_describe_is_a_clear_error():
    """fingerprint("cuda") on a CPU build raised torch's bare AssertionError."""
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bik.fingerprint: cuda is not available here"):
            bik.fingerprint("cuda")
    with pytest.raises(ValueError, match="bik.fingerprint: device must be cpu or cuda, got meta"):
        bik.fingerprint("meta")
