"""bik::sample and bik::verify_draft (op.py); backends triton.py, cuda.py, cpu.py."""

from bik.ops.sampling.op import SampleOutput, VerifyOutput, bik_log_torch, sample, verify_draft

__all__ = ["SampleOutput", "VerifyOutput", "bik_log_torch", "sample", "verify_draft"]
