"""bik::sample and bik::verify_draft (op.py); backends triton.py, cuda.py, cpu.py."""

from bik.ops.sampling.op import SampleOutput, VerifyOutput, sample, verify_draft

__all__ = ["SampleOutput", "VerifyOutput", "sample", "verify_draft"]
