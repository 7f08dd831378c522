"""The decode-verify-rollback loop on a GPU (skipped without CUDA): bf16, Triton kernels as the
verifier, cuBLAS and torch SDPA as the fast path (whose split-K choices follow the batch, so
rollbacks happen without forcing them)."""

from __future__ import annotations

import pytest
import torch
from bik.dvr import DVREngine, EngineConfig, NgramDrafter, reference_decode
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.model import embedded_model
from bik.dvr.workload import make_workload, run_workload

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,group,drafter", [(4, 4, 0), (16, 8, 3)])
def test_gpu_outputs_equal_solo_reference(dtype, window, group, drafter):
    device = torch.device("cuda")
    model = embedded_model(seed=0, dtype=dtype, device=device)
    arrivals = make_workload(vocab_size=model.config.vocab_size, num_requests=12, seed=1,
                             det_fraction=0.75, max_new_tokens=(16, 32), temperature=0.8,
                             arrival_spread=6, repetitive=drafter > 0)
    engine = DVREngine(model, EngineConfig(window=window, group=group, mismatch_rate=0.1,
                                           drafter=NgramDrafter(drafter) if drafter else None),
                       fast_kernels=FastKernels(), verify_kernels=BikKernels(),
                       device=device, dtype=dtype)
    outputs = run_workload(engine, arrivals)
    for a in arrivals:
        if a.request.deterministic:
            ref = reference_decode(model, a.request, BikKernels(), device=device, dtype=dtype)
            assert outputs[a.request.request_id].tokens == ref.tokens
            assert outputs[a.request.request_id].logprobs == ref.logprobs
    assert engine.pool.num_free == engine.pool.num_blocks
