"""The house rules of docs/design.md ("House rules"), checked on the package's source (ast).

* Imports point down: cli -> dvr, testing, integrations -> models -> distributed -> bik -> mode -> ops/<op>/op.py -> ops/<op>/<backend>.py
  -> configs, runtime -> _arch, _dtypes. Lazy imports inside functions count.
* runtime/ knows no op: it imports nothing of bik but _arch and _dtypes.
* An op's slice never imports another op's modules (it calls the public torch.ops.bik op).
* An op's reference.py (its contract in torch) is imported by tests only.
* bik.testing ships for users: no Triton internals, no nvcc / cuobjdump (those live in tools/).
* bik/kernels/ (the old layer-by-layer floor plan) is gone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bik
import pytest

PKG = Path(bik.__file__).resolve().parent

# Lower layers may be imported by higher ones, never the reverse.
LAYERS = [
    ("bik._arch", "bik._dtypes", "bik._cpu_kernels"),
    ("bik.configs", "bik.runtime"),
    ("bik.ops._registry", "bik.ops._checks", "bik.ops._pointwise"),
    ("bik.ops.*.<backend>",),  # an op's backend modules and their private helpers
    ("bik.ops.*.op", "bik.ops.*.backward", "bik.ops.*", "bik.ops", "bik.fingerprint"),
    ("bik.mode",),
    ("bik",),
    ("bik.distributed",),
    ("bik.models",),
    ("bik.dvr", "bik.testing", "bik.integrations"),
    ("bik.cli", "bik.__main__"),
]
_OP_TOP = {"op", "backward"}  # the modules of a slice that define and register the op


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] == "ops" and not parts[2].startswith("_"):
        # bik.ops.<op>[.<module>]: the package and op/backward on top, the rest below
        return 4 if len(parts) == 3 or parts[3] in _OP_TOP else 3
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if name == prefix or (prefix != "bik" and name.startswith(prefix + ".")):
                return i
    raise AssertionError(f"{name}: no layer in LAYERS")


def _is_module(package: str, name: str) -> bool:
    where = PKG.parent / package.replace(".", "/")
    return ((where / f"{name}.py").exists() or (where / name / "__init__.py").exists()
            or any(where.glob(f"{name}.*.so")))


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from bik.ops.matmul import cpu`` imports the submodule bik.ops.matmul.cpu
            subs = [f"{node.module}.{a.name}" for a in node.names if _is_module(node.module, a.name)]
            found += [(node.lineno, s) for s in subs] or [(node.lineno, node.module)]
    return [(line, name) for line, name in found if name == "bik" or name.startswith("bik.")]


SOURCES = sorted(PKG.rglob("*.py"))
EDGES = [(_module_name(p), line, target) for p in SOURCES for line, target in _imports(p)]


def test_the_old_kernels_layer_is_gone():
    assert not (PKG / "kernels").exists()


def test_every_module_has_a_layer():
    for path in SOURCES:
        _layer(_module_name(path))


@pytest.mark.parametrize("name", sorted({e[0] for e in EDGES}))
def test_imports_point_down(name):
    upward = [f"line {line}: {target}" for src, line, target in EDGES
              if src == name and _layer(target) > _layer(name)]
    assert not upward, f"{name} imports upward: {upward}"


def test_runtime_knows_no_op():
    bad = [(src, target) for src, _, target in EDGES if src.startswith("bik.runtime")
           and not target.startswith(("bik._arch", "bik._dtypes", "bik.runtime", "bik._cpu"))]
    assert not bad, bad


def test_an_op_slice_imports_no_other_slice():
    def slice_of(name):
        parts = name.split(".")
        return parts[2] if len(parts) >= 3 and parts[1] == "ops" and not parts[2].startswith(
            "_") else None

    bad = [(src, target) for src, _, target in EDGES
           if slice_of(src) and slice_of(target) and slice_of(src) != slice_of(target)]
    assert not bad, bad


def test_reference_modules_are_for_tests_only():
    bad = [(src, target) for src, _, target in EDGES if target.endswith(".reference")
           and target.startswith("bik.ops.")]
    assert not bad, bad


def test_bik_testing_ships_no_developer_tooling():
    for path in (PKG / "testing").rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module}
        assert not {m for m in modules if m and m.split(".")[0] in ("triton", "subprocess")}, path
        assert "cuobjdump" not in text and "nvcc" not in text, path
