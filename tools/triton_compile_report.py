"""Compile every Triton kernel config for sm_90 and sm_80 (no GPU needed) and record shared
memory, registers and spills as JSON: `python tools/triton_compile_report.py bench/results/NAME.json`."""

from __future__ import annotations

import datetime
import json
import sys

import bik
import triton
from triton_compile_table import ARCHS, compile_all


def main(path: str) -> None:
    records = [r._asdict() | {"fits": r.fits} for arch in ARCHS for r in compile_all(arch)]
    payload = {
        "what": "triton.compile for GPUTarget('cuda', arch, 32) on a machine without a GPU; "
                "registers and spills from the triton wheel's ptxas -v",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"bik": bik.__version__, "triton": triton.__version__},
        "config_hash": bik.fingerprint("cpu").config_hash,
        "records": records,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
        f.write("\n")
    worst = max(records, key=lambda r: r["registers"])
    print(f"{len(records)} configs; all fit: {all(r['fits'] for r in records)}; "
          f"spills: {sum(r['spill_stores'] + r['spill_loads'] for r in records)} B; "
          f"max registers {worst['registers']} ({worst['kernel']} sm{worst['arch']})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "compile_report.json")
