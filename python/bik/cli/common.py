"""Helpers the CLI commands share: device choice, run metadata, JSON output."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import torch

import bik
from bik import _dtypes

DTYPES = {d.short: d.dtype for d in _dtypes.DTYPES}  # the CLI spells dtypes as the configs do


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a bad value is argparse's one-line error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def seed(text: str) -> int:
    """An argparse type: a request seed, an int in [0, 2**63) (vLLM reads -1 as no seed, and
    seeds a torch generator with it, which takes a signed 64-bit value)."""
    from bik.rl.loop import SEED_LIMIT  # the one bound bik rl checks its config with

    value = int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def output_path(text: str) -> str:
    """An argparse type for a file the command writes at its end (--json, --plot): checked
    before any work, so a run's results are never lost to a path that cannot be written. The
    file, if it exists, must be a writable file; else its nearest existing ancestor a writable
    directory (the missing ones are made when writing)."""
    import os
    from pathlib import Path

    path = Path(text)
    if path.exists():
        if not path.is_file() or not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a writable file")
        return text
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {ancestor} is not a writable "
                                         f"directory")
    return text


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SystemExit(f"bik: --device must be cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bik: --device cuda asked for, but torch sees no CUDA device")
    return device


_CPU_FLAGS = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
              "amx_bf16", "amx_tile", "amx_int8"}


def _cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def run_metadata(device: torch.device) -> dict:
    """Who, where and when: attached to every JSON record the CLI writes."""
    fp = bik.fingerprint(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_info().get("model name"),
        # the features that pick a kernel here or in the stock library it is compared with
        "cpu_flags": sorted(set(_cpu_info().get("flags", "").split()) & _CPU_FLAGS),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
                       if k in os.environ},
        "cpus": os.cpu_count(),
        # 1/5/15-minute load averages when the run ended: a loaded machine explains noisy rows
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "versions": fp.versions,
        "fingerprint": fp.as_dict(),
    }


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def make_console():
    """A rich console as wide as the terminal, 80 columns when output is not a terminal (CI,
    pipes); :func:`print_table` splits the tables that do not fit."""
    import sys

    from rich.console import Console

    # In logs, prose lines stay whole (soft wrap: greps and tests see them on one line);
    # tables are laid out for 80 columns either way.
    return Console() if sys.stdout.isatty() else Console(width=80, soft_wrap=True)


@contextmanager
def progress(description: str, total: int):
    """A transient progress bar on a terminal, advanced by calling what this yields; nothing
    when output is not a terminal (logs stay clean)."""
    import sys

    if not sys.stdout.isatty():
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(console=make_console(), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def _column_width(column) -> int:
    from rich.text import Text

    cells = [column.header, *column.cells]
    return max(Text.from_markup(c).cell_len if isinstance(c, str) else 8 for c in cells) + 3


def print_table(console, table, *, keys: int = 1) -> None:
    """Print a rich Table, split into as many tables as the console's width needs: each part
    repeats the first ``keys`` columns (what names a row) and takes the next columns that fit.
    The cells are never truncated; --json keeps every field anyway."""
    from rich.measure import Measurement
    from rich.table import Table

    natural = Measurement.get(console, console.options.update_width(10**5), table).maximum
    if natural <= console.width:
        console.print(table)
        return
    columns = table.columns
    widths = [_column_width(c) for c in columns]
    base = 1 + sum(widths[:keys])
    parts, part, used = [], [], base
    for i in range(keys, len(columns)):
        if part and used + widths[i] > console.width:
            parts.append(part)
            part, used = [], base
        part.append(i)
        used += widths[i]
    parts.append(part)
    cells = [list(c.cells) for c in columns]
    for n, part in enumerate(parts, 1):
        chosen = [*range(keys), *part]
        title = f"{table.title} ({n}/{len(parts)})" if table.title else None
        out = Table(title=title)
        for i in chosen:
            out.add_column(columns[i].header, justify=columns[i].justify,
                           overflow=columns[i].overflow)
        for row in range(table.row_count):
            out.add_row(*(cells[i][row] for i in chosen))
        console.print(out)


def end_spawned_rank() -> None:
    """End a torch.multiprocessing rank that finished cleanly, skipping the interpreter's
    finalization: measured on gloo worlds here, about one run in four had a rank abort there
    ("terminate called without an active exception") after its work, its final barrier and
    destroy_process_group had all returned. Work that fails raises before this, as usual."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
