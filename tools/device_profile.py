"""Where a decode step's eager calls spend their time: device_check.sh's profile stage.

    python tools/device_profile.py OUT_DIR [--dry-run]

For each call of `bik bench boundary`'s host-route table (bik.linear 1 x 4096 x 4096,
bik.rms_norm, decode attention over 1024 keys, bik.sample over 128256 tokens; bf16, Triton):

* the kernels each call runs on the device, by name, from torch.profiler's device events (so
  a launch the host-side counting could miss is still seen), and their device µs per call;
* the host µs per call (each call timed alone after a sync);
* cProfile's top functions over 300 calls of each (host Python, launch included).

Writes ``profile.json`` (the above) and ``linear_trace.json.gz`` (a Chrome trace of 20
``bik.linear`` calls, CPU and device). ``--dry-run``: on a machine without a GPU, the host side
only, through bik.runtime.triton_dry_run (the recorder's launches stand in for device events);
the tests run it so.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import gzip
import io
import json
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

CALLS_PER_PROFILE = 20
CPROFILE_CALLS = 300


def _host_us(fn, sync) -> float:
    samples = []
    for _ in range(50):
        sync()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _device_kernels(fn) -> tuple[dict, float, object]:
    """(kernel name -> launches per call, device µs per call, the profile) from device events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS_PER_PROFILE):
            fn()
        torch.cuda.synchronize()
    names, device_us = collections.Counter(), 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
            device_us += e.time_range.elapsed_us()
    return ({k: v / CALLS_PER_PROFILE for k, v in names.items()},
            device_us / CALLS_PER_PROFILE, prof)


def _top_functions(fn, limit: int = 20) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CPROFILE_CALLS):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from bik.cli.bench.host_route import _calls

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("device_profile: no CUDA device (use --dry-run for the host side)")
        (args.out / "profile.json").write_text(json.dumps({"gpu": None}))
        return 0
    device = torch.device("cuda" if on_gpu else "cpu")
    context = contextlib.nullcontext(None)
    if not on_gpu:
        from bik.runtime.triton_dry_run import dry_run

        context = dry_run()
    report = {"gpu": torch.cuda.get_device_name() if on_gpu else None,
              "dry_run": not on_gpu, "torch": torch.__version__, "calls": {}}
    with torch.no_grad(), context as run:
        for name, (call, _) in _calls(device, "triton").items():
            call()
            entry: dict = {}
            if on_gpu:
                entry["host_us"] = _host_us(call, torch.cuda.synchronize)
                kernels, device_us, prof = _device_kernels(call)
                entry |= {"kernels_per_call": kernels, "device_us": device_us}
                if name.startswith("linear"):
                    trace = args.out / "linear_trace.json"
                    prof.export_chrome_trace(str(trace))
                    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    trace.unlink()
            else:
                entry["host_us"] = _host_us(call, lambda: None)
                before = len(run.launches)
                call()
                entry["launches_per_call"] = dict(collections.Counter(
                    launch.name for launch in run.launches[before:]))
            entry["top_functions"] = _top_functions(call)
            report["calls"][name] = entry
            summary = {k: v for k, v in entry.items() if k != "top_functions"}
            print(f"{name}: {summary}")
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
