"""`bik` / `python -m bik`: microbenchmarks, the demo and the invariance doctor."""

from __future__ import annotations

import argparse

from bik.cli.common import output_path, positive_int

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(positive_int(v) for v in text.split(",") if v)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bik", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="time bik against torch and check rows stay identical")
    from bik.cli.bench import BENCHES

    bench.add_argument("op", choices=tuple(BENCHES))
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    bench.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"))
    bench.add_argument("--backend", default=None, choices=("triton", "cuda", "cpu"),
                       help="bik backend (default: by device)")
    bench.add_argument("--ms", type=_ints, default=None,
                       help="comma-separated batch sizes (attention: decode batches)")
    bench.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    bench.add_argument("--json", metavar="PATH", type=output_path,
                       help="write records as JSON")
    bench.add_argument("--plot", metavar="PATH", type=output_path,
                       help="PNG of torch time / bik time")
    bench.add_argument("--model", default=None, metavar="NAME",
                       help="dvr: 'smollm2', the real checkpoint (with HF generate alongside); "
                            "vllm: a Hugging Face directory (default SmolLM2)")
    bench.add_argument("--split", choices=("fixed", "none"), default=None,
                       help="matmul: only this K-split contract (default: both)")
    bench.add_argument("--spec", action="store_true",
                       help="vllm: speculative decoding (ngram, the fast-path draft) vs none")
    bench.add_argument("--profile", action="store_true",
                       help="vllm: where the decode step's time goes (torch.profiler)")
    bench.add_argument("--tp", type=positive_int, default=2,
                       help="tp: ranks of the gloo world (processes; default 2)")

    demo = sub.add_parser("demo", help="show a stock path's bits change with batch, bik's not")
    demo.add_argument("--device", default=None)
    demo.add_argument("--real", action="store_true",
                      help="HF generate on the real SmolLM2 checkpoint, alone vs left-padded "
                           "batch, stock vs bik (make checkpoint; minutes on a CPU)")
    demo.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                      help="with --real (default bf16)")
    demo.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                      help="with --real: HF's attn_implementation (default sdpa, HF's own)")
    demo.add_argument("--new-tokens", type=positive_int, default=48,
                      help="with --real (default 48)")

    check = sub.add_parser("check", help="run the invariance harness on this device")
    check.add_argument("--device", default=None)
    check.add_argument("--quick", action="store_true", help="fewer shapes and batch sizes")
    check.add_argument("--json", metavar="PATH", type=output_path,
                       help="write the verdicts as JSON")

    from bik.cli.dvr import add_dvr_arguments

    add_dvr_arguments(sub.add_parser(
        "dvr", help="decode-verify-rollback on a small Llama: metrics and a determinism verdict"))

    from bik.cli.rl import add_rl_arguments

    add_rl_arguments(sub.add_parser(
        "rl", help="GRPO steps on SmolLM2 with vLLM sampling and HF training: the trainer's "
                   "logprobs vs the engine's per step (needs the vLLM venv)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from bik.cli.bench import run_bench

        return run_bench(args)
    if args.command == "demo":
        if args.real:
            from bik.cli.demo_real import run_demo_real

            return run_demo_real(args)
        from bik.cli.demo import run_demo

        return run_demo(args)
    if args.command == "dvr":
        from bik.cli.dvr import run_dvr

        return run_dvr(args)
    if args.command == "rl":
        from bik.cli.rl import run_rl

        return run_rl(args)
    from bik.cli.check import run_check

    return run_check(args)
