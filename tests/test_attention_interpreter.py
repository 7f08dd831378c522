"""bik.attention's Triton kernels under TRITON_INTERPRET=1 (own process; see
tests/test_triton_interpreter.py for what the interpreter can and cannot prove). The interpreter
table uses a split of 32 keys and blocks of 16, so lengths of a few dozen cross several splits
and several blocks per split."""

import attention_cases as ac
import pytest
import torch
from conftest import INTERPRETER
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

TRITON = ac.bik_attn("triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(params=["fold", "split"])
def launch_mode(request, monkeypatch):
    """Run every test in both launch modes: each must keep the contract on its own."""
    from bik.ops.attention import triton as triton_attention

    monkeypatch.setattr(triton_attention, "use_split_mode",
                        lambda *args: request.param == "split")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_decode_verify_same_bits(dtype, launch_mode):
    ac.check_chunking(TRITON, dtype, 70, (1, 7, 16, 33), d=16)


@pytest.mark.parametrize("gqa", [(4, 4), (6, 2), (8, 1)])
def test_chunking_gqa_ratios(gqa, launch_mode):
    ac.check_chunking(TRITON, torch.float32, 40, (1, 5), hq=gqa[0], hkv=gqa[1], d=16)


def test_page_sizes(launch_mode):
    ac.check_page_sizes(TRITON, torch.float32, 45, (16, 1, 64, 7), d=16)


@pytest.mark.parametrize("q_len", [1, 4, 19])
def test_random_neighbours_and_rows(q_len, launch_mode):
    ac.check_neighbours(TRITON, torch.float32, 50, q_len, n_neighbours=3, max_len=70, d=16)


def test_split_and_fold_modes_agree(monkeypatch):
    from bik.ops.attention import triton as triton_attention

    outs = []
    for mode in (True, False):
        monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args, m=mode: m)
        gen = torch.Generator().manual_seed(0)
        req = ac.make_request(gen, 75, 4, 2, 32, torch.bfloat16)
        cache = ac.pack_paged([req], [75], 16, gen)
        outs.append(TRITON(req.q[60:], cache.k_cache, cache.v_cache, cache.cache_seqlens,
                           torch.tensor([0, 15], dtype=torch.int32), cache.block_table))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_contiguous_and_varlen_agree(dtype):
    ac.check_layouts_agree("triton", dtype, [1, 20, 50], d=32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy(dtype, launch_mode):
    ac.check_accuracy("triton", dtype, [1, 33, 70], [1, 10, 70], d=32)


def test_opcheck():
    ac.check_opcheck("triton")


@settings(deadline=None, derandomize=True, max_examples=8)
@given(length=st.integers(1, 60), chunk=st.integers(1, 20), page=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]))
def test_hypothesis_chunking(length, chunk, page, gqa):
    ac.check_chunking(TRITON, torch.float32, length, (chunk,), hq=gqa[0], hkv=gqa[1], d=16,
                      page_size=page)


def test_same_check_rejects_a_split_size_chosen_by_length(monkeypatch):
    """Negative control on the real kernel: with SPLIT picked from the cached length (as
    length-adaptive split-KV does), the chunking check must fail."""
    import dataclasses

    from bik.ops.attention import triton as triton_attention

    fixed = triton_attention.attention_config
    launch = triton_attention.launch_attention

    def launch_with_split_by_length(*args, max_k_len, **kwargs):
        split = 16 if max_k_len < 40 else 32
        monkeypatch.setattr(triton_attention, "attention_config",
                            lambda *key: dataclasses.replace(fixed(*key), split=split))
        launch(*args, max_k_len=max_k_len, **kwargs)

    monkeypatch.setattr(triton_attention, "launch_attention", launch_with_split_by_length)
    with pytest.raises(AssertionError, match="rows differ"):
        ac.check_chunking(TRITON, torch.float32, 70, (1,), d=16)
