"""bik on torch.distributed process groups: tensor-parallel layers, a vocab-parallel sampler and
expert-parallel mixture-of-experts layers whose bits do not depend on the number of ranks (docs/design.md, "Tensor parallelism"; docs/api.md, "bik.distributed").

Every function here is a collective over ``group`` (default: the world): all ranks call it with
matching arguments. Before any compute the ranks exchange a description of their inputs and
their ``bik.fingerprint()``; a mismatch raises ValueError on every rank. Set a timeout on the
process group (``init_process_group(..., timeout=...)``) so a rank that never arrives cannot
hang the others.
"""

from bik.distributed.linear import column_parallel_linear, row_parallel_linear
from bik.distributed.moe import expert_parallel_experts
from bik.distributed.sampling import vocab_parallel_sample, vocab_parallel_verify_draft

__all__ = ["column_parallel_linear", "expert_parallel_experts", "row_parallel_linear",
           "vocab_parallel_sample", "vocab_parallel_verify_draft"]
