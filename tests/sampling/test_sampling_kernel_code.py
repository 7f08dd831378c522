"""The compiled code of the Triton sampler kernels (compiled for sm_90 and sm_80, not run).

In the plain process, no GPU needed: the noise + pick kernel (gumbel_pick_kernel), the top-p
rows' statistics (top_p_pass_kernel: a pass of the top-p search spread over the row's
groups; top_p_finish_kernel: the passes a row still needs, on one program), the other rows'
(group_max_kernel, group_mass_kernel) and the finish (finish_kernel: the splits' merge, the
group fold, bik_log and the logprob), compiled for
every dtype and vocabulary size of the launch table, use only exactly rounded fp32 ops: no
div.full, .approx, fma, ex2, lg2 or rcp in their PTX, and div.rn.f32 present (mul.hi.u32 in the
pick's Philox). That is what lets tokens and logprobs equal the CPU path's on a GPU
(docs/design.md#sampler, "Cross-backend promise").
"""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("name", ["gumbel_pick_kernel", "top_p_pass_kernel", "top_p_finish_kernel",
                                  "group_max_kernel", "group_mass_kernel", "finish_kernel"])
def test_sampler_kernel_code_has_no_approximation_or_fma(arch, name):
    """The compiled kernel uses only exactly rounded fp32 ops: no div.full, no .approx, no
    fma."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_compile import launch_like_signature
    from triton_compile_table import sampling_kernel_cases

    picks = [c for c in sampling_kernel_cases(arch) if c[0].__name__ == name]
    assert {str(c[1]["x_ptr"].dtype) for c in picks} >= {"torch.float32", "torch.bfloat16",
                                                       "torch.float16"}
    for kernel, args, consts, warps, stages, options in picks:  # every dtype and vocab size
        sig, constants, attrs = launch_like_signature(kernel, args, consts)
        ptx = triton.compile(ASTSource(kernel, sig, constants, attrs),
                             target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": warps, "num_stages": stages} | options
                             ).asm["ptx"]
        for banned in ("div.full", ".approx", "fma", "ex2", "lg2", "rcp"):
            assert banned not in ptx, banned
        assert re.search(r"div\.rn\.f32", ptx)
        assert name != "gumbel_pick_kernel" or re.search(r"mul\.hi\.u32", ptx)
