"""tools/build_cache.py: an entry is built once by concurrent builders (threads and processes, as
pytest-xdist workers), an edited input is a miss, a failed build stores nothing, and
``BIK_BUILD_CACHE=off`` builds every time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import build_cache
import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"

# A builder process: appends its pid to ``log`` when it builds, sleeps so the others must wait.
_BUILDER = """
import os, sys, time
sys.path.insert(0, {tools!r})
import build_cache

def build(out):
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(0.5)
    out.write_text("built")

print(build_cache.cached_file("x.txt", {key!r}, build).read_text())
"""


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("BIK_BUILD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_processes_build_an_entry_once(root, tmp_path):
    log = tmp_path / "builds.log"
    code = _BUILDER.format(tools=str(TOOLS), log=str(log), key="k1")
    env = os.environ | {"BIK_BUILD_CACHE": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == ["built"] * 3
    assert len(log.read_text().split()) == 1


def test_threads_build_an_entry_once(root):
    calls = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.2)
        out.write_text("x")

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: build_cache.cached_file("t.txt", "k2", build), range(4)))
    assert len(calls) == 1 and len(set(paths)) == 1 and paths[0].read_text() == "x"


def test_an_edited_input_is_a_miss(root, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cu").write_text("one")
    before = build_cache.files_digest([src])
    (src / "a.cu").write_text("two")
    assert build_cache.files_digest([src]) != before
    assert build_cache.digest("cmd", before) != build_cache.digest("cmd", "other")


def test_a_key_names_what_is_built_not_where_the_clone_lives(tmp_path, monkeypatch):
    """Two clones of the same sources, each its own REPO: the same keys (nvcc's -I and the
    inputs named by path), while an edited input in one of them is a miss."""
    keys = []
    for clone in ("a", "b"):
        src = tmp_path / clone / "csrc"
        src.mkdir(parents=True)
        (src / "k.cu").write_text("one")
        monkeypatch.setattr(build_cache, "REPO", tmp_path / clone)
        keys.append(build_cache.digest("nvcc", ["-I", str(src), str(src / "k.cu")],
                                       build_cache.files_digest([src])))
    assert keys[0] == keys[1]
    (src / "k.cu").write_text("two")
    assert build_cache.digest("nvcc", ["-I", str(src), str(src / "k.cu")],
                              build_cache.files_digest([src])) != keys[1]
    assert build_cache.digest("ptx", f".file 1 \"{sys.prefix}/x.py\"") == \
        build_cache.digest("ptx", '.file 1 "<venv>/x.py"')


def test_ptxas_reports_are_keyed_by_code_not_by_debug_paths():
    """Triton's PTX names its source by absolute path (.file and the DWARF bytes): two clones'
    PTX of one kernel share a ptxas report; another instruction does not."""
    from triton_compile import _code_of

    def ptx(path: str, op: str) -> str:
        dwarf = " ".join(f".b8 {b}" for b in path.encode())
        return (f'.target sm_90a\n\t.file\t1 "{path}"\n\t.loc\t1 3 0\n\t{op} %r1, %r2, %r3;\n'
                f".section\t.debug_info\n{{\n.b32 {len(path)}\n{dwarf}\n}}\n")

    assert _code_of(ptx("/tmp/a/k.py", "add.s32")) == _code_of(ptx("/work/bb/k.py", "add.s32"))
    assert _code_of(ptx("/tmp/a/k.py", "add.s32")) != _code_of(ptx("/tmp/a/k.py", "sub.s32"))


def test_a_failed_build_stores_nothing(root):
    def fail(out: Path) -> None:
        out.write_text("half")
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        build_cache.cached_file("f.txt", "k3", fail)
    assert not (root / "k3").exists()
    assert build_cache.cached_bytes("f.txt", "k3", lambda: b"ok") == b"ok"


def test_off_builds_every_time(monkeypatch):
    monkeypatch.setenv("BIK_BUILD_CACHE", "off")
    calls = []

    def produce() -> bytes:
        calls.append(1)
        return b"y"

    key = f"k4-{os.getpid()}-{time.monotonic_ns()}"
    assert build_cache.cached_bytes("o.txt", key, produce) == b"y"
    assert build_cache.cached_bytes("o.txt", key, produce) == b"y"
    assert len(calls) == 2
