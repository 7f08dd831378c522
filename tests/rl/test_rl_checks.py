"""bik.rl's pieces without an engine (the main venv; the loop on vLLM is
tests/vllm_plugin/test_rl.py): what it refuses and with which message, the packed trainer's
logprobs equal to each sequence's alone under bik.enable(), the GRPO loss at rho = 1, the
reward."""

from __future__ import annotations

import importlib.util

import bik
import pytest
import torch
from bik.rl import RLConfig, check_config, check_fingerprints
from bik.rl import engine, task
from bik.rl.trainer import advantages, grpo_loss, packed_logprobs, positions

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("change, message", [
    ({"min_p": 0.1}, "min_p=0.1 is refused"),
    ({"min_p": float("nan")}, r"min_p must be a finite number in \[0.0, 1.0\], got nan"),
    ({"top_k": -2}, "top_k must be an integer >= 0, got -2"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0, got 2.5"),
    ({"top_p": 0.0}, r"top_p must be a finite number in \(0.0, 1.0\], got 0.0"),
    ({"engine_dtype": "bfloat16"}, "the engine's dtype bfloat16 is not the trainer's float32"),
    ({"dtype": "float16"}, "dtype must be float32 or bfloat16, got 'float16'"),
    ({"temperature": 0.0}, r"temperature must be a finite number in \(0.0, inf\], got 0.0"),
    ({"temperature": float("inf")}, "temperature must be a finite number .* got inf"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"prompts": 0}, "prompts must be an integer >= 1, got 0"),
    ({"group": 0}, "group must be an integer >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
    ({"lr": -1e-5}, r"lr must be a finite number in \[0.0, inf\], got -1e-05"),
    ({"lr": float("nan")}, "lr must be a finite number .* got nan"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"seed": 2**63 - 2}, "request seeds up to .* past 2\\*\\*63 - 1"),
])
def test_rl_refuses_what_it_does_not_serve(change, message):
    """Each field checked (issue 50: RLConfig accepted steps 0, a NaN lr, a NaN min-p, an
    infinite temperature, a fractional top-k and a negative seed, which vLLM reads as none)."""
    with pytest.raises(ValueError, match=f"bik rl: .*{message}"):
        check_config(RLConfig(**change))
    check_config(RLConfig(seed=2**63 - 1 - 1000 - 15, steps=2, prompts=4, group=4))  # the last


def test_rl_names_both_fingerprints_when_they_differ():
    check_fingerprints("aaaa", ["aaaa"])
    with pytest.raises(RuntimeError, match="fingerprint bbbb is not the trainer's aaaa"):
        check_fingerprints("aaaa", ["aaaa", "bbbb"])
    with pytest.raises(RuntimeError, match="reported no bik fingerprint"):
        check_fingerprints("aaaa", [])


def test_a_bad_weight_update_is_refused_naming_each_weight():
    """Every offender is named (issue 50: only the first 5 were), NaN and inf refused (they
    passed), and a bf16 tensor for an fp32 weight is an error, never a cast."""
    expected = {f"w{i}": (torch.Size([2, 3]), torch.float32) for i in range(8)}
    good = {f"w{i}": torch.zeros(2, 3) for i in range(8)}
    engine.check_update(good, expected)
    bad = {f"w{i}": torch.zeros(3, 2) for i in range(7)} | {"extra": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"nothing pushed \(9 offenders\): unknown names "
                                         r"\['extra'\], missing \['w7'\], wrong shape or "
                                         r"dtype \['w0: \(3, 2\).*'w6: \(3, 2\)"):
        engine.check_update(bad, expected)
    with pytest.raises(ValueError, match=r"w1: \(2, 3\) torch.bfloat16, expected \(2, 3\) "
                                         r"torch.float32"):
        engine.check_update(good | {"w1": torch.zeros(2, 3, dtype=torch.bfloat16)}, expected)
    nan = torch.zeros(2, 3)
    nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf in \['w2', 'w5'\]"):
        engine.check_update(good | {"w2": nan, "w5": torch.full((2, 3), float("inf"))},
                            expected)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_rl_without_vllm_says_how_to_install_it():
    with pytest.raises(RuntimeError, match="make venv-vllm"):
        engine.start("/nonexistent", "float32", bik_on=True)


def _model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=96, max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()


def test_packed_logprobs_need_position_ids_and_equal_each_sequence_alone():
    """The trainer's packed forward (position_ids restarting per sequence) gives each
    sequence's logprobs bit for bit as its own forward does, under bik.enable(), at T = 1 and
    0.7; without position_ids it refuses."""
    model = _model()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (9, 17, 5)]
    targets = [s[-3:] for s in seqs]
    with pytest.raises(ValueError, match="needs position_ids restarting at 0 per sequence"):
        packed_logprobs(model, seqs, targets, [1.0] * 3, None)
    with bik.enabled():
        packed = packed_logprobs(model, seqs, targets, [1.0, 0.7, 1.0], positions(seqs))
        alone = [packed_logprobs(model, [s], [t], [temp], positions([s]))[0]
                 for s, t, temp in zip(seqs, targets, [1.0, 0.7, 1.0])]
    assert all(p.requires_grad for p in packed)
    assert all(torch.equal(p, a) for p, a in zip(packed, alone))


def test_grpo_at_rho_one_is_the_policy_gradient():
    """With the engine's logprobs equal to the trainer's, rho = 1: the loss is minus the mean
    advantage, and its gradient is minus A / |o| times each token's logprob gradient."""
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    adv = advantages([1.0, 0.0], 2)
    assert adv == pytest.approx([1.0, -1.0], abs=1e-3)
    loss = grpo_loss(lp, [t.detach() for t in lp], adv)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(adv[0] + adv[1]) / 2)
    assert torch.allclose(lp[0].grad, torch.full((2,), -adv[0] / 4))
    assert torch.allclose(lp[1].grad, torch.full((1,), -adv[1] / 2))


def test_reward_reads_the_last_integer():
    p = task.Problem("What is 26 + 28?", 54)
    assert task.reward(p, "26 + 28 = 54") == 1.0
    assert task.reward(p, "26 + 28 is indeed 54.") == 1.0
    assert task.reward(p, "54 is not 26 + 28 = 55") == 0.0
    assert task.reward(p, "Two sixes.") == 0.0
    assert task.problems(3, 0) == task.problems(3, 0) != task.problems(3, 1)
