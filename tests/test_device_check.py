"""tools/device_check.sh and its summary, on this machine (no GPU needed).

A device run returns at most 8 files, so the script's OUT holds a summary JSON and one tarball;
the summary must say what passed, failed and skipped from the junit XML alone. Here: a real
pytest run with one pass, one failure and one skip is summarised, and the script itself, where
torch sees no CUDA device, writes only its summary and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_summary_counts_failures_and_skips_from_junit(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    suite = tmp_path / "test_three.py"
    suite.write_text("import pytest\n"
                     "def test_ok(): pass\n"
                     "def test_bad(): assert 1 == 2\n"
                     "def test_skip(): pytest.skip('no cuda-core')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(suite), "--junitxml",
                          str(raw / "gpu_tests.xml")],
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    (raw / "gpu_tests.log").write_text(run.stdout)
    (raw / "env.json").write_text(json.dumps({"gpu": "test"}))
    (raw / "stages.jsonl").write_text(
        json.dumps({"stage": "gpu_tests", "rc": run.returncode, "seconds": 1}) + "\n"
        + json.dumps({"stage": "bench_dvr", "rc": None, "note": "skipped: budget spent"}) + "\n")
    out = tmp_path / "device_check.json"
    subprocess.run([sys.executable, str(ROOT / "tools/device_check_summary.py"), str(raw),
                    str(out)], check=True)
    got = json.loads(out.read_text())
    assert got["env"] == {"gpu": "test"}
    tests = got["stages"][0]
    assert tests["rc"] == 1
    assert {k: tests["pytest"][k] for k in ("tests", "failures", "errors", "skipped")} == \
        {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}
    assert tests["pytest"]["failed"] == ["test_three::test_bad"]
    assert "assert 1 == 2" in tests["log_tail"]
    assert got["stages"][1] == {"stage": "bench_dvr", "rc": None, "note": "skipped: budget spent"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_device_check_without_a_gpu_writes_only_its_summary(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "tools/device_check.sh"), str(out)],
                         capture_output=True, text=True, check=False, timeout=120,
                         env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert "no CUDA device" in run.stdout
    assert [p.name for p in out.iterdir()] == ["device_check.json"]
    assert json.loads((out / "device_check.json").read_text())["env"] == {"gpu": None}


def _plan(parts: str | None = None) -> list[tuple[str, int]]:
    args = ["bash", str(ROOT / "tools/device_check.sh"), "/dev/null/never-written"]
    run = subprocess.run(args + ([parts] if parts else []), capture_output=True, text=True,
                         check=False, timeout=60, env={"PLAN": "1", "PATH": "/usr/bin:/bin",
                                                       "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    return [(name, int(limit)) for _, name, limit in
            (line.split() for line in run.stdout.splitlines() if line.startswith("plan "))]


@pytest.mark.parametrize("parts", [None, "bench", "triton", "cuda", "dvr"])
def test_each_calls_deadlines_fit_its_budget(parts):
    """A stage's deadline is taken whole unless the budget runs out first, so every call's
    deadlines add up to at most BUDGET - 30 s (540 - 30): no stage starves a later one, and
    the first call (the default parts) returns every headline benchmark before any test."""
    plan = _plan(parts)
    assert plan and sum(limit for _, limit in plan) <= 540 - 30, plan
    names = [name for name, _ in plan]
    if parts in (None, "bench"):  # the first call: every headline number, no test
        benches = [n for n in names if n.startswith("bench_")]
        assert benches == ["bench_matmul", "bench_sample", "bench_attention", "bench_rmsnorm",
                           "bench_layer", "bench_boundary"]
        assert names[-2:] == ["check", "profile"]
        assert not [n for n in names if n.startswith(("gpu_", "cuda_"))]
    if parts == "triton":  # the matmul in the other dtypes, then the Triton GPU tests
        assert names.index("bench_matmul_fp32") < min(names.index(n) for n in names
                                                      if n.startswith("gpu_"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without a GPU")
def test_the_profile_stage_runs_its_host_side_on_the_dry_run(tmp_path):
    """tools/device_profile.py, the first call's last stage: on a GPU it reads the kernels from
    the profiler's device events; here its host side runs through the sm_90 dry run, and the
    launches it records are the budgets of tests/test_launch_path.py."""
    run = subprocess.run([sys.executable, str(ROOT / "tools/device_profile.py"), str(tmp_path),
                          "--dry-run"], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "profile.json").read_text())
    calls = report["calls"]
    assert report["dry_run"] and len(calls) == 4
    launches = {name.split()[0]: entry["launches_per_call"] for name, entry in calls.items()}
    assert launches["linear"] == {"matmul_kernel": 1}
    assert launches["rms_norm"] == {"rms_norm_kernel": 1}
    assert launches["attention"] == {"attention_kernel": 1}
    assert sum(launches["sample"].values()) == 4
    assert all(entry["host_us"] > 0 and "launch" in entry["top_functions"]
               for entry in calls.values())
