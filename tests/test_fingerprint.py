"""bik.fingerprint(): stable for unchanged inputs, changed by any config-table change."""

import dataclasses

import torch

import bik
from bik import configs


def test_fingerprint_is_stable_and_complete():
    a, b = bik.fingerprint("cpu"), bik.fingerprint(torch.device("cpu"))
    assert a == b
    assert a.arch in ("cpu", "interpreter")
    assert set(a.backends) == {"matmul", "bmm", "rms_norm", "fused_add_rms_norm"}
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
