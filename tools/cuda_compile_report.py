"""Compile every CUDA C++ kernel file (csrc/cuda/*.cu) for sm_80 and sm_90a with NVRTC and nvcc
(no GPU needed) and record registers, shared memory, stack, local memory and spills per kernel as
JSON: `python tools/cuda_compile_report.py bench/results/cuda_compile_resources_DATE.json`."""

from __future__ import annotations

import datetime
import json
import shutil
import sys

import bik
import cuda_compile as cc
from bik.runtime import cuda_aot, cuda_jit


def main(path: str) -> None:
    nvcc = shutil.which("nvcc")
    records = []
    for source in cc.cuda_sources():
        for arch in cc.ARCHS:
            records += [r._asdict() for r in cc.nvrtc_records(source, arch)[1]]
            if nvcc:
                records += [r._asdict() for r in cc.nvcc_records(source, arch, nvcc)]
    payload = {
        "what": "csrc/cuda kernels compiled without a GPU: NVRTC (the JIT; resources from "
                "cuobjdump --dump-resource-usage, shared includes sm_90's reserved 1 KiB) and "
                "nvcc (the AOT build; ptxas --resource-usage, spills)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"bik": bik.__version__, "nvrtc": ".".join(map(str, cuda_jit.nvrtc_version())),
                     "nvcc": cuda_aot.nvcc_version(nvcc) if nvcc else None},
        "flags": {"nvrtc": "-std=c++17 --fmad=false, warnings are errors",
                  "nvcc": " ".join(cuda_aot.NVCC_FLAGS)},
        "cuda_source_hash": cuda_jit.sources_hash()[:16],
        "records": records,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    spills = sum(max(r["spill_stores"], 0) + max(r["spill_loads"], 0) for r in records)
    stack = max(r["stack"] + r["local"] for r in records)
    worst = max(records, key=lambda r: r["registers"])
    print(f"{len(records)} kernel builds; spills {spills} B; max stack+local {stack} B; max "
          f"registers {worst['registers']} ({worst['kernel']} {worst['arch']} {worst['compiler']})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda_compile_report.json")
