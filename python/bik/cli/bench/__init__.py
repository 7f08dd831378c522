"""`bik bench NAME`: bik vs torch, plus a bit-identity check, one module per bench.

``BENCHES`` maps a bench's name to the module that defines its ``run(device, dtype, args) ->
records`` (plain dicts), ``render(records, console)`` and ``plot(records, plt, path)`` (None when
the bench has no plot: ``--plot`` is then refused), and, for a bench that takes ``--backend``,
``BACKEND_OP``: the op whose backends it chooses among. Modules are imported when their bench
runs, so `bik bench boundary` does not import the DVR engine.
"""

from __future__ import annotations

import importlib

from bik.cli.bench.stream import partial_path, streaming
from bik.cli.common import DTYPES, make_console, pick_device, run_metadata, write_json
from bik.ops._registry import BackendUnavailableError, resolve_backend

__all__ = ["BENCHES", "run_bench"]

BENCHES = {
    "matmul": "bik.cli.bench.matmul",
    "rmsnorm": "bik.cli.bench.rmsnorm",
    "softmax": "bik.cli.bench.softmax",
    "attention": "bik.cli.bench.attention",
    "sample": "bik.cli.bench.sample",
    "boundary": "bik.cli.bench.boundary",
    "dvr": "bik.cli.bench.dvr",
    "generate": "bik.cli.bench.generate",
    "vllm": "bik.cli.bench.vllm",
    "rl": "bik.cli.bench.rl",
    "tp": "bik.cli.bench.tp",
    "layer": "bik.cli.bench.layer",
    "linear": "bik.cli.bench.linear",
    "moe": "bik.cli.bench.moe",
}


def _save_plot(bench, records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"bik bench --plot needs matplotlib (pip install 'bik[plot]'): {exc}")
    bench.plot(records, plt, path)


def _check_backend(name: str, bench, backend: str | None, device) -> None:
    """A --backend the bench cannot run is a one-line error before any work."""
    if backend is None:
        return
    op = getattr(bench, "BACKEND_OP", None)
    if op is None:
        raise SystemExit(f"bik bench {name}: --backend does not apply to this bench")
    try:
        resolve_backend(op, backend, device)
    except (BackendUnavailableError, ValueError) as exc:
        raise SystemExit(f"bik bench {name}: {exc}") from None


def run_bench(args) -> int:
    bench = importlib.import_module(BENCHES[args.op])
    if args.plot and bench.plot is None:
        raise SystemExit(f"bik bench {args.op}: --plot is not available for this bench")
    console = make_console()
    device = pick_device(args.device)
    _check_backend(args.op, bench, args.backend, device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    with streaming(args.json):
        records = bench.run(device, dtype, args)
    bench.render(records, console)
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "records": records})
        partial_path(args.json).unlink(missing_ok=True)  # the whole run is in args.json
    if args.plot and records:
        _save_plot(bench, records, args.plot)
    stable = all(r.get("bik_rows_identical", True) for r in records)
    if not stable:
        console.print("[red]bik rows changed with the batch: this is a bug, please report it")
    return 0 if stable else 1
