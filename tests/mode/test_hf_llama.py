"""A real client: a small Hugging Face Llama under bik.batch_invariant_mode.

Random weights from a seeded LlamaConfig (no download). Prompts have equal lengths; left
padding (with positions from the mask, as HF's generate passes them) is
test_left_padding_keeps_the_bits_with_positions_from_the_mask, and on the real checkpoint
tests/models/test_smollm2.py.
"""

import bik
import pytest
import torch
from bik.runtime import cpu_ext
from bik.testing import probe_every_position, rows_alone_vs_batched, same_bits

transformers = pytest.importorskip("transformers")

VOCAB = 128
GEN_TOKENS = 32

# (device, dtype, attention, grad context). On CUDA the fused SDPA kernels run below autograd
# where the mode does not route them, so the GPU SDPA variant runs under inference_mode, where
# the mode sees aten::scaled_dot_product_attention itself (docs/integration.md).
SETUPS = [
    pytest.param("cpu", torch.float32, "eager", torch.no_grad, id="cpu-fp32-eager"),
    pytest.param("cpu", torch.float32, "sdpa", torch.no_grad, id="cpu-fp32-sdpa"),
    pytest.param("cpu", torch.float32, "sdpa", torch.inference_mode, id="cpu-fp32-sdpa-inference"),
    pytest.param("cuda", torch.bfloat16, "eager", torch.no_grad, id="cuda-bf16-eager",
                 marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, "sdpa", torch.inference_mode,
                 id="cuda-bf16-sdpa-inference", marks=pytest.mark.gpu),
]


def make_model(device="cpu", dtype=torch.float32, attention="eager", intermediate_size=128):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        attn_implementation=attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def prompts(n: int, length: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + length)
    return torch.randint(3, VOCAB, (n, length), generator=gen).to(device)  # no bos/eos/pad ids


def next_token_logits(model):
    return lambda ids: model(ids).logits[:, -1]


@pytest.fixture(autouse=True)
def _require_cpu_kernels(request):
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device", "cpu") if callspec else "cpu"
    if device == "cpu" and not cpu_ext.available():
        pytest.skip("CPU extension not built")
    bik.reset_mode_stats()


@pytest.mark.parametrize("device,dtype,attention,grad", SETUPS)
@pytest.mark.parametrize("length", [1, 24])
def test_next_token_logits_alone_and_in_batches(device, dtype, attention, grad, length):
    model = make_model(device, dtype, attention)
    fn = next_token_logits(model)
    pool = prompts(8, length, device)
    with grad(), bik.batch_invariant_mode():
        batches = rows_alone_vs_batched(fn, pool, (1, 2, 3, 5, 8), name="llama")
        probe = probe_every_position(fn, pool[:1], pool[1:], name="llama probe")
    assert batches.ok, batches
    assert probe.ok, probe
    routed = bik.mode_stats().routed
    assert routed.get("aten.mm.default", 0) + routed.get("aten.linear.default", 0) > 0
    if attention == "sdpa":
        assert not bik.mode_stats().fallbacks
        assert any("scaled_dot_product" in op for op in routed)


@pytest.mark.parametrize("device,dtype,attention,grad", SETUPS)
def test_greedy_generate_bs1_equals_bsN(device, dtype, attention, grad):
    model = make_model(device, dtype, attention)
    ids = prompts(4, 24, device)

    def generate(x):
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GEN_TOKENS,
                             min_new_tokens=GEN_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.scores, dim=1)

    with grad(), bik.batch_invariant_mode():
        tokens, scores = generate(ids)
        alone = [generate(ids[i:i + 1]) for i in range(ids.shape[0])]
    assert tokens.shape == (4, 24 + GEN_TOKENS)
    assert not bik.mode_stats().fallbacks  # nothing ran on a stock kernel
    for i, (tok1, score1) in enumerate(alone):
        assert torch.equal(tokens[i], tok1[0]), i
        assert same_bits(scores[i], score1[0]), i


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_mode_logits_match_stock_within_fp32_error(attention):
    """Invariance alone would not catch a wrong layout in a routed op: compare values too."""
    model = make_model(attention=attention)
    ids = prompts(3, 24, "cpu")
    with torch.no_grad():
        stock = model(ids).logits
        with bik.batch_invariant_mode():
            routed = model(ids).logits
    torch.testing.assert_close(routed, stock, rtol=1e-4, atol=1e-5)
    assert not same_bits(routed, stock)  # bik's kernels really ran


def test_without_the_mode_prompt_length_1_differs():
    """Negative control, measured on the project's CPUs: stock fp32 mm computes a row at M = 1
    differently from M >= 4, so a one-token prompt's logits move with the batch size. (At prompt
    length 24 every matmul has M >= 24 and the stock CPU path was measured invariant.)"""
    fn = next_token_logits(make_model())
    pool = prompts(8, 1, "cpu")
    with torch.no_grad():
        report = rows_alone_vs_batched(fn, pool, (1, 4, 8), name="stock llama")
    assert not report.ok
    assert {m for m, _ in report.mismatches} <= {4, 8}


def _left_padded(ids, pad: int):
    """ids left-padded by ``pad`` tokens, with HF's mask and the position ids HF's generate
    derives from it (each real token keeps its unpadded position)."""
    padded = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), torch.ones_like(ids)], dim=1)
    return padded, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_left_padding_keeps_the_bits_with_positions_from_the_mask():
    """Eager attention, CPU: a left-padded prompt (1-8 pads, positions from the mask) gives its
    unpadded logits bit for bit under the mode; padded keys add exact zeros, and the CPU
    softmax's lane sums only rotate (tests/models/test_smollm2.py has the reasoning and the real
    checkpoint). Stock fails for most pad counts at prompt length 5 (measured here). Without
    position ids from the mask the padded prompt is another input: its positions shift."""
    model = make_model(attention="eager")
    ids = prompts(1, 5, "cpu")
    stock_differs = 0
    with torch.no_grad():
        for pad in range(1, 9):
            padded, mask, positions = _left_padded(ids, pad)
            stock_differs += not same_bits(
                model(ids).logits[:, -1],
                model(padded, attention_mask=mask, position_ids=positions).logits[:, -1])
            with bik.batch_invariant_mode():
                plain = model(ids).logits[:, -1]
                pad_logits = model(padded, attention_mask=mask, position_ids=positions)
                assert same_bits(plain, pad_logits.logits[:, -1]), pad
                shifted = model(padded, attention_mask=mask).logits[:, -1]
                assert not same_bits(plain, shifted), pad
    assert stock_differs >= 4, stock_differs
    assert bik.mode_stats().fallbacks == {}


# Forward and backward under grad through the mode: tests/mode/test_hf_llama_backward.py.


@pytest.mark.parametrize("front", [bik.batch_invariant_mode, bik.enabled],
                         ids=["mode", "enabled"])
def test_a_trainers_right_padded_batch_keeps_each_sequences_bits(front):
    """SDPA, train mode, grad on: four sequences of 5-17 tokens right-padded into one batch
    with HF's attention mask give every real position the logits of the sequence alone, and
    the backward runs (the masked backward is torch's formula). Stock fails the same check
    (measured here)."""
    model = make_model(attention="sdpa").train()
    gen = torch.Generator().manual_seed(7)
    lengths = (5, 9, 13, 17)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.stack([torch.cat([s, torch.zeros(17 - len(s), dtype=s.dtype)]) for s in seqs])
    mask = torch.stack([(torch.arange(17) < len(s)).long() for s in seqs])

    def differing(batch_logits, alone) -> list[int]:
        return [b for b, s in enumerate(seqs)
                if not same_bits(batch_logits[b, :len(s)], alone(s[None])[0])]

    stock = model(ids, attention_mask=mask).logits
    assert differing(stock, lambda x: model(x).logits), "stock kept every sequence's bits"
    with front():
        logits = model(ids, attention_mask=mask).logits
        assert differing(logits, lambda x: model(x).logits) == []
        logits.float().log_softmax(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("front", [bik.batch_invariant_mode, bik.enabled],
                         ids=["mode", "enabled"])
def test_a_trainers_packed_sequences_keep_each_sequences_bits(front):
    """SDPA, train mode, grad on, no cache (as trainers run): four sequences packed into one
    row with position_ids restarting per sequence (transformers then builds a block-diagonal
    causal mask) give
    every position the logits of its sequence alone; each block is one varlen sequence
    (mode/_masks.py). Stock fails the same check (measured here)."""
    model = make_model(attention="sdpa").train()
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 9, 13, 17)]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    bounds = [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]

    def differing(packed_logits, alone) -> list[int]:
        return [i for i, s in enumerate(seqs)
                if not same_bits(packed_logits[0, bounds[i]:bounds[i + 1]], alone(s[None])[0])]

    stock = model(ids, position_ids=positions, use_cache=False).logits
    assert differing(stock, lambda x: model(x).logits), "stock kept every sequence's bits"
    bik.reset_mode_stats()
    with front():
        logits = model(ids, position_ids=positions, use_cache=False).logits
        assert differing(logits, lambda x: model(x).logits) == []
        logits.float().log_softmax(-1).sum().backward()
    assert not any("scaled_dot_product_attention" in key and "backward" not in key
                   for key in bik.mode_stats().fallbacks), bik.mode_stats().fallbacks


@pytest.mark.parametrize("front", [bik.batch_invariant_mode, bik.enabled],
                         ids=["mode", "enabled"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa-forced"])
def test_a_right_padded_batchs_input_gradients_are_each_sequences_alone(front, kv_heads,
                                                                        monkeypatch):
    """Train mode: the gradient of a masked loss with respect to the input embeddings is, for
    every real position, the sequence's gradient alone (the masked SDPA backward runs per
    sequence). With GQA only when transformers passes enable_gqa with a mask too
    (TRANSFORMERS_SDPA_FORCE_GQA=1): by default it repeats K/V before SDPA when a mask is
    given and not without one, so the two calls sum a KV head's query groups in different
    orders. Stock fails the same check (measured here)."""
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1" if kv_heads < 4 else "0")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=256,
        attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 9, 13, 17)]
    ids = torch.stack([torch.cat([s, torch.zeros(17 - len(s), dtype=s.dtype)]) for s in seqs])
    mask = torch.stack([(torch.arange(17) < len(s)).long() for s in seqs])

    def grads(ids, mask=None):
        x = model.get_input_embeddings()(ids).detach().requires_grad_()
        logp = model(inputs_embeds=x, attention_mask=mask).logits.float().log_softmax(-1)
        weight = torch.ones(logp.shape[:2]) if mask is None else mask.float()
        (logp[..., 3] * weight).sum().backward()  # a loss over the real positions only
        return x.grad

    def differing() -> list[int]:
        batch = grads(ids, mask)
        return [b for b, s in enumerate(seqs)
                if not same_bits(batch[b, :len(s)], grads(s[None])[0])]

    assert differing(), "stock kept every sequence's gradient"
    with front():
        assert differing() == []
