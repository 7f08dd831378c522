"""bik.fingerprint(): stable for unchanged inputs, changed by any config-table change and by
any edit to a package file that is not excluded with its reason (fingerprint.EXCLUDED)."""

import dataclasses
import functools
import importlib
import shutil
from pathlib import Path

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


def test_the_cpu_path_is_reported_outside_the_digest(monkeypatch):
    """The CPU backend's SIMD path, resolved once, is in ``variants``; the digest ignores it
    (every path's bits are equal: tests/matmul/test_matmul_cpu_kernel.py and its siblings)."""
    from bik.ops import _registry
    from bik.runtime import cpu_ext

    before = bik.fingerprint("cpu")
    want = cpu_ext.isa("auto") if cpu_ext.available() else None
    assert before.variants.get("cpu") == want
    assert "triton" not in before.variants and "cuda" not in before.variants
    monkeypatch.setattr(importlib.import_module("bik.fingerprint"), "backend_variant",
                        lambda b: "generic" if b == "cpu" else None)
    after = bik.fingerprint("cpu")
    assert after.variants == {"cpu": "generic"} and after.digest == before.digest
    assert _registry.backend_variant.cache_info().currsize >= 1  # resolved once, then kept


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


def _fp_module():
    return importlib.import_module("bik.fingerprint")  # bik.fingerprint is the function


def _package_copy(tmp_path: Path) -> Path:
    """The package's .py files under tmp_path/bik: a tree the tests may edit (the real package
    stays untouched, so parallel test processes never see a stray module)."""
    pkg = _fp_module()._PKG
    root = tmp_path / "bik"
    for src in pkg.rglob("*.py"):
        if "__pycache__" not in src.parts:
            dst = root / src.relative_to(pkg)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return root


def test_every_package_file_is_hashed_or_excluded_with_a_reason():
    """Read from the disk, not from numeric_sources: a module in neither set fails here."""
    fp_mod = _fp_module()
    pkg = fp_mod._PKG

    def rel(paths):
        return {p.relative_to(pkg).as_posix() for p in paths}

    on_disk = rel(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    hashed, excluded = rel(fp_mod.numeric_sources()), rel(fp_mod.excluded_sources())
    assert not hashed & excluded
    assert on_disk - hashed - excluded == set(), "neither hashed nor excluded"
    for pattern, reason in fp_mod.EXCLUDED.items():
        assert reason.strip() and list(pkg.glob(pattern)), f"{pattern}: stale or unexplained"
    for must in ("configs.py", "_arch.py", "_dtypes.py", "ops/_pointwise.py",
                 "ops/matmul/cpu.py", "runtime/cpu_ext.py", "mode/_forward_routes.py",
                 "mode/_grad_routes.py", "distributed/sampling.py", "dvr/model.py",
                 "dvr/reference.py", "integrations/vllm/sampler.py", "models/smollm2.py"):
        assert must in hashed, must
    assert not any(p.startswith(("cli/", "testing/")) for p in hashed)
    assert not any(p.startswith("ops/") and p.endswith("/reference.py") for p in hashed)


def test_the_hash_follows_the_package_tree(tmp_path):
    """Paths are relative to the package root: a copy of the package hashes the same."""
    fp_mod = _fp_module()
    assert fp_mod.source_hash(_package_copy(tmp_path)) == fp_mod.source_hash()


def test_a_new_module_under_mode_changes_the_hash_and_the_digest(tmp_path, monkeypatch):
    """Negative control: mode/ was not hashed once; any new module anywhere that is not
    excluded changes the source hash, and through it the digest."""
    fp_mod = _fp_module()
    root = _package_copy(tmp_path)
    monkeypatch.setattr(fp_mod, "source_hash", functools.partial(fp_mod.source_hash, root))
    before = bik.fingerprint("cpu")
    (root / "mode" / "_new_route.py").write_text("SCALE = 2.0\n")
    after = bik.fingerprint("cpu")
    assert after.source_hash != before.source_hash and after.digest != before.digest


@pytest.mark.parametrize(("edit", "hashed"), [
    *((path, True) for path in ("dvr/model.py", "distributed/sampling.py",
                                "integrations/vllm/sampler.py", "ops/_pointwise.py")),
    *((path, False) for path in ("cli/main.py", "cli/bench/new_bench.py", "testing/harness.py",
                                 "ops/matmul/reference.py", "__main__.py")),
])
def test_an_edit_changes_the_hash_unless_the_file_is_excluded(tmp_path, edit, hashed):
    fp_mod = _fp_module()
    root = _package_copy(tmp_path)
    before = fp_mod.source_hash(root)
    with (root / edit).open("a") as f:
        f.write("# edited\n")
    assert (fp_mod.source_hash(root) != before) == hashed


def test_cpu_extension_carries_its_source_hash():
    """The loaded extension was built from the checkout's csrc/cpu (setup.py's hash of the
    sources, baked in): a stale build in place, e.g. one the build cache handed over without
    setuptools copying it into the source tree, is caught here."""
    import hashlib

    from bik.runtime import cpu_ext

    if cpu_ext.available():
        assert cpu_ext.source_hash() not in (None, "unknown")
        sources = sorted((Path(bik.__file__).parents[2] / "csrc" / "cpu").glob("*.[ch]*"))
        if sources:  # a checkout (an editable install), not a wheel
            h = hashlib.sha256()
            for path in sources:
                h.update(path.name.encode() + path.read_bytes())
            assert cpu_ext.source_hash() == h.hexdigest()[:16]


def test_a_device_it_cannot_describe_is_a_clear_error():
    """fingerprint("cuda") on a CPU build raised torch's bare AssertionError."""
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bik.fingerprint: cuda is not available here"):
            bik.fingerprint("cuda")
    with pytest.raises(ValueError, match="bik.fingerprint: device must be cpu or cuda, got meta"):
        bik.fingerprint("meta")
