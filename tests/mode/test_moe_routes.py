"""Mixture-of-experts blocks under the front ends (mode/_moe_routes.py): the grouped product.

Hugging Face's default experts implementation (``grouped_mm``) sorts the (token, expert) pairs
by expert and multiplies each expert's rows as one group of ``torch._grouped_mm``. Stock CPU
runs a group with torch's mm, whose rows change bits with the group's size, so a token's
output follows how many other tokens chose its experts. bik routes it to bik::grouped_matmul
(each row bik::matmul's bits), and the weight gradient's layout to its weight-gradient op.
With it, a Hugging Face MoE model's logits are the same alone as batched under bik.enable()
for each of transformers' experts implementations (grouped_mm, eager, batched_mm).
"""

import bik
import bik.moe
import pytest
import torch
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

FRONT_ENDS = {"mode": bik.batch_invariant_mode, "enabled": bik.enabled}
SIZES = (1, 2, 5, 8)


def _experts(gen, groups=3, k=64, n=48):
    return torch.randn(groups, k, n, generator=gen)


def _one_group(w):
    """Every row in group 0 (the grouped product of a batch that chose one expert)."""
    ends = torch.tensor([1, 1, 1], dtype=torch.int32)
    return lambda rows: torch._grouped_mm(rows, w, ends * rows.shape[0])


def test_stock_grouped_mm_is_not_row_invariant(gen):
    """Measured negative control: a row computed alone in its group differs from the same row
    among others in fp32 (torch's mm at one row and at several)."""
    w = _experts(gen)
    assert not rows_alone_vs_batched(_one_group(w), torch.randn(8, 64, generator=gen),
                                     SIZES).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("front", FRONT_ENDS)
def test_grouped_mm_rows_are_invariant_and_each_groups_product(front, dtype, gen):
    w = _experts(gen).to(dtype)
    pool = torch.randn(8, 64, generator=gen).to(dtype)
    ends = torch.tensor([3, 3, 8], dtype=torch.int32)  # an empty group in the middle
    with torch.no_grad(), FRONT_ENDS[front]():
        report = rows_alone_vs_batched(_one_group(w), pool, SIZES)
        got = torch._grouped_mm(pool, w, ends)
    assert report.ok, report.summary()
    want = torch.cat([bik.matmul(pool[:3], w[0]), bik.matmul(pool[3:], w[2])])
    assert torch.equal(got, want)
    assert bik.mode_stats().routed.get("aten._grouped_mm.default", 0) > 0


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_grouped_mm_weight_gradient_layout_is_each_groups_product(front, gen):
    """2-D by 2-D with groups along the rows' dimension (autograd's weight gradient of the
    grouped product): group g's columns of a times its rows of b, by bik.matmul; stock's value
    to within fp32 rounding."""
    a, g = torch.randn(64, 8, generator=gen), torch.randn(8, 48, generator=gen)
    ends = torch.tensor([3, 3, 8], dtype=torch.int32)
    bik.reset_mode_stats()
    with torch.no_grad(), FRONT_ENDS[front]():
        got = torch._grouped_mm(a, g, ends)
    assert got.shape == (3, 64, 48)
    assert torch.equal(got[0], bik.matmul(a[:, :3], g[:3]))
    assert torch.equal(got[1], torch.zeros(64, 48))
    assert torch.equal(got[2], bik.matmul(a[:, 3:], g[3:]))
    torch.testing.assert_close(got, torch._grouped_mm(a, g, ends))
    assert not bik.mode_stats().fallbacks


def _stock_error(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_grouped_mm_leaves_other_layouts_and_torchs_errors_to_torch(gen):
    """3-D rows by 3-D groups (no offsets) and group ends that decrease run the stock kernel,
    counted and warned (stock accepts both); a call torch rejects (a bias, which stock does
    not support) gets torch's own error under bik too."""
    w, x = _experts(gen), torch.randn(8, 64, generator=gen)
    bik.reset_mode_stats()
    with torch.no_grad(), bik.enabled(), pytest.warns(bik.BatchInvarianceWarning):
        got = torch._grouped_mm(x.reshape(2, 4, 64), w[:2])
    assert torch.equal(got, torch._grouped_mm(x.reshape(2, 4, 64), w[:2]))
    assert any("_grouped_mm" in key for key in bik.mode_stats().fallbacks)
    ends = torch.tensor([2, 4, 8], dtype=torch.int32)
    calls = [lambda: torch._grouped_mm(x, w, ends, bias=torch.zeros(3, 48)),
             lambda: torch._grouped_mm(x, w, torch.tensor([5, 2, 8], dtype=torch.int32))]
    with torch.no_grad():
        stock = [_stock_error(call) for call in calls]
        assert stock[0] is not None and stock[1] is None  # measured: a bias raises, ends don't
        with bik.enabled(), pytest.warns(bik.BatchInvarianceWarning, match="ends"):
            assert [_stock_error(call) for call in calls] == stock


def _logits_alone_vs_batched(model, ids) -> list[bool]:
    """Per sequence of ``ids``: its logits alone equal its row of the batch's, bit for bit."""
    with torch.no_grad():
        batched = model(ids).logits
        return [torch.equal(model(ids[i:i + 1]).logits[0], batched[i])
                for i in range(ids.shape[0])]


def _tiny_qwen3_moe(experts: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=256,
                         norm_topk_prob=True, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager",
                                             experts_implementation=experts)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager", "batched_mm"])
def test_hf_moe_logits_alone_equal_batched_under_enable(experts, dtype):
    """A tiny random Qwen3-MoE (4 experts, top-2) under each experts implementation
    transformers offers: each sequence's logits are the same alone as in a batch of 6 under
    bik.enable(). grouped_mm needs the grouped product's route; eager (a loop over experts,
    index_add_ into zeros in ascending expert id, sequential on the CPU) and batched_mm (a
    bmm per token, then a sum over the top-k slots) need bik's mm, bmm, softmax, sum and silu.
    Control: stock measured to differ in fp32 (in bf16 stock's CPU products were measured
    invariant at these sizes, so bf16 has no stock control here)."""
    model = _tiny_qwen3_moe(experts, dtype)
    assert model.config._experts_implementation == experts
    ids = torch.randint(0, 256, (6, 3), generator=torch.Generator().manual_seed(1))

    if dtype == torch.float32:
        assert not all(_logits_alone_vs_batched(model, ids))  # stock
    bik.reset_mode_stats()
    with bik.enabled():
        assert all(_logits_alone_vs_batched(model, ids))
    stats = bik.mode_stats()
    # The eager loop's int64 sums (its expert mask) are exact and stay stock.
    assert set(stats.fallbacks) <= {"aten.sum.dim_IntList: dtype int64"}, stats.fallbacks
    if experts == "grouped_mm":
        assert stats.routed.get("aten._grouped_mm.default", 0) > 0


@pytest.mark.parametrize("experts", ["grouped_mm", "eager", "batched_mm"])
def test_hf_moe_input_gradients_are_each_sequences_own(experts):
    """Train mode, fp32: the gradient of a loss with respect to each sequence's input
    embeddings is the same alone as in a batch of 6 under bik.enable() (the grouped product's
    input gradient is a grouped product and its weight gradient, a reduction over each
    group's tokens, bik::grouped_matmul_weight_grad: both routed, nothing falls back). Stock
    measured to differ."""
    model = _tiny_qwen3_moe(experts, torch.float32).train()
    ids = torch.randint(0, 256, (6, 3), generator=torch.Generator().manual_seed(1))

    def grads(rows: slice) -> torch.Tensor:
        emb = model.get_input_embeddings()(ids[rows]).detach().requires_grad_()
        model(inputs_embeds=emb).logits.logsumexp(-1).sum().backward()
        return emb.grad

    def grads_alone_vs_batched() -> list[bool]:
        batched = grads(slice(0, 6))
        return [torch.equal(grads(slice(i, i + 1))[0], batched[i]) for i in range(6)]

    assert not all(grads_alone_vs_batched())  # stock
    bik.reset_mode_stats()
    with bik.enabled():
        assert all(grads_alone_vs_batched())
    stats = bik.mode_stats()
    assert set(stats.fallbacks) <= {"aten.sum.dim_IntList: dtype int64"}, stats.fallbacks


def test_topk_and_sort_take_bik_s_order_on_ties_and_unsorted(gen):
    """bik's rule: descending values, ties by the lowest index, sorted or not. Stock measured
    to differ on both counts (its tie order and its sorted=False order), which is why a
    trainer and an engine whose kernels differ sum a token's experts in different orders."""
    ties = torch.tensor([[0.5, 0.7, 0.5, 0.7, 0.1, 0.7]])
    x = torch.rand(4, 64, generator=gen)
    stock_ties = torch.topk(ties, 3).indices
    stock_unsorted = torch.topk(x, 8, sorted=False).indices
    assert stock_ties.tolist() != [[1, 3, 5]]  # measured: [[3, 5, 1]]
    assert not torch.equal(stock_unsorted, torch.topk(x, 8).indices)
    bik.reset_mode_stats()
    for front in FRONT_ENDS.values():
        with front():
            assert torch.topk(ties, 3, sorted=False).indices.tolist() == [[1, 3, 5]]
            assert torch.topk(ties, 2, largest=False).indices.tolist() == [[4, 0]]
            assert torch.sort(ties, descending=True).indices.tolist() == [[1, 3, 5, 0, 2, 4]]
            unsorted = torch.topk(x, 8, sorted=False)
            nan = torch.topk(torch.tensor([1.0, float("nan"), 2.0]), 2).indices.tolist()
        assert torch.equal(unsorted.indices, torch.sort(x, descending=True, stable=True)
                           .indices[:, :8])
        assert unsorted.values.is_contiguous() and nan == [1, 2]  # NaN the largest, as torch
    assert bik.mode_stats().routed["aten.topk.default"] >= 2
    with bik.enabled(), pytest.raises(RuntimeError, match="selected index k out of range"):
        torch.topk(ties, 7)  # torch's own error


def _tiny_glm4_moe(experts: str, dtype: torch.dtype):
    """GLM-4.5-style: sigmoid scores with a correction bias, group-limited top-3 of 8 experts
    in 2 groups, renormalised and scaled by 2.5, a shared expert."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    torch.manual_seed(0)
    cfg = Glm4MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                        first_k_dense_replace=0, norm_topk_prob=True, vocab_size=256,
                        max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager",
                                             experts_implementation=experts)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, 0, 0.05)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_hf_glm4_moe_logits_alone_equal_batched_under_enable(experts, dtype):
    """The GLM-4.5-style router (sigmoid, groups, unsorted top-k) on top of the grouped
    product: each sequence's logits the same alone as in a batch of 6, nothing falls back."""
    model = _tiny_glm4_moe(experts, dtype)
    ids = torch.randint(0, 256, (6, 5), generator=torch.Generator().manual_seed(1))

    stock = _logits_alone_vs_batched(model, ids)
    bik.reset_mode_stats()
    with bik.enabled():
        assert all(_logits_alone_vs_batched(model, ids))
    stats = bik.mode_stats()
    assert set(stats.fallbacks) <= {"aten.sum.dim_IntList: dtype int64"}, stats.fallbacks
    assert stats.routed.get("aten.sigmoid.default", 0) > 0
    assert stats.routed.get("aten.topk.default", 0) > 0
    if dtype == torch.float32:
        assert not all(stock), "stock measured invariant: the control no longer fails"


def _tiny_mixtral(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=8, num_experts_per_tok=2, vocab_size=256,
                        max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return model.eval()


def _family_block(family: str, dtype: torch.dtype):
    """(the MoE block of layer 0, its router's bik.moe.route arguments, logits of x)."""
    if family == "qwen3_moe":
        block = _tiny_qwen3_moe("grouped_mm", dtype).model.layers[0].mlp
        cfg = block.gate
        return block, dict(top_k=cfg.top_k, renormalize=cfg.norm_topk_prob), \
            lambda x: torch.nn.functional.linear(x, block.gate.weight)
    if family == "mixtral":
        block = _tiny_mixtral(dtype).model.layers[0].mlp
        return block, dict(top_k=block.gate.top_k, renormalize=True), \
            lambda x: torch.nn.functional.linear(x, block.gate.weight)
    block = _tiny_glm4_moe("grouped_mm", dtype).model.layers[0].mlp
    gate = block.gate
    return block, dict(top_k=gate.top_k, renormalize=gate.norm_topk_prob, n_group=gate.num_group,
                       topk_group=gate.topk_group, correction_bias=gate.e_score_correction_bias,
                       scaling=gate.routed_scaling_factor), \
        lambda x: torch.nn.functional.linear(x.float(), gate.weight.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_bik_moe_is_the_transformers_code_op_for_op(family, dtype, gen):
    """bik.moe.route + bik.moe.experts (what vLLM's plugin runs) give the bits of the family's
    own router and grouped_mm experts under bik.enable(), for 1 and 9 tokens, with the experts'
    weights as they are or packed once (PackedExperts); a token's output alone equals its row
    among 9."""
    block, args, logits_of = _family_block(family, dtype)
    x = torch.randn(9, 64, generator=gen).to(dtype)
    with torch.no_grad(), bik.enabled():
        _, want_w, want_ids = block.gate(x)
        want = block.experts(x, want_ids, want_w)
        weights, ids = bik.moe.route(family, logits_of(x), **args)
        got = bik.moe.experts(x, ids, weights, block.experts.gate_up_proj,
                              block.experts.down_proj)
        one = bik.moe.experts(x[3:4], ids[3:4], weights[3:4], block.experts.gate_up_proj,
                              block.experts.down_proj)
        packed = bik.moe.experts(x, ids, weights, block.experts.gate_up_proj,
                                 block.experts.down_proj, bik.moe.PackedExperts(
                                     block.experts.gate_up_proj, block.experts.down_proj))
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert torch.equal(got, want) and torch.equal(one[0], got[3])
    assert torch.equal(packed, got)  # the experts packed once: the same bits


def test_bik_moe_refuses_a_family_it_has_not_transcribed():
    with pytest.raises(NotImplementedError, match="model_type 'qwen2_moe' is not served"):
        bik.moe.route("qwen2_moe", torch.zeros(1, 4), 2, renormalize=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_bik_moe_ties_and_a_nan_token_stay_with_their_token(family, gen):
    """Router ties go to the lowest expert id, alone as in a batch; a token whose router
    logits are NaN gets NaN out (its weights are NaN; NaN counts as the largest score, so its
    experts are the lowest ids), and every other token keeps the bits it has without it."""
    block, args, logits_of = _family_block(family, torch.float32)
    x = torch.randn(6, 64, generator=gen)
    w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
    with torch.no_grad(), bik.enabled():
        logits = logits_of(x)
        logits[2] = 0.0  # every expert tied
        weights, ids = bik.moe.route(family, logits, **args)
        alone = bik.moe.route(family, logits[2:3], **args)
        clean = bik.moe.experts(x, ids, weights, w13, w2)
        logits[4] = float("nan")
        nan_weights, nan_ids = bik.moe.route(family, logits, **args)
        dirty = bik.moe.experts(x, nan_ids, nan_weights, w13, w2)
    k = args["top_k"]
    if family == "qwen3_moe":  # one group: the k lowest ids
        assert ids[2].tolist() == list(range(k))
    assert torch.equal(alone[1][0], ids[2]) and torch.equal(alone[0][0], weights[2])
    assert dirty[4].isnan().all()
    keep = [0, 1, 2, 3, 5]
    assert torch.equal(nan_ids[keep], ids[keep]) and torch.equal(dirty[keep], clean[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_bik_moe_transcribes_transformers_other_experts_implementations(implementation, dtype,
                                                                        gen):
    """bik.moe.experts(implementation=...) gives the bits of the GLM-4.5-style block's experts
    set to that implementation (top-3: eager's expert-id order and per-add rounding differ from
    grouped_mm's slot sum, measured here), with the weights as they are or packed (eager)."""
    gate_up_down = {}
    x = torch.randn(9, 64, generator=gen).to(dtype)
    for impl in ("grouped_mm", implementation):
        block = _tiny_glm4_moe(impl, dtype).model.layers[0].mlp
        with torch.no_grad(), bik.enabled():
            _, weights, ids = block.gate(x)
            gate_up_down[impl] = block.experts(x, ids, weights)
    w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
    with torch.no_grad(), bik.enabled():
        got = bik.moe.experts(x, ids, weights, w13, w2, implementation=implementation)
        packed = bik.moe.experts(x, ids, weights, w13, w2, bik.moe.PackedExperts(w13, w2),
                                 implementation=implementation)
    assert torch.equal(got, gate_up_down[implementation]) and torch.equal(packed, got)
    if implementation == "eager":  # the control: another implementation, other bits
        assert not torch.equal(gate_up_down["eager"], gate_up_down["grouped_mm"])


def test_the_experts_implementation_setting_is_checked(monkeypatch):
    monkeypatch.setenv("BIK_MOE_EXPERTS", "")
    assert bik.moe.experts_implementation() == "grouped_mm"
    monkeypatch.setenv("BIK_MOE_EXPERTS", "eager")
    assert bik.moe.experts_implementation() == "eager"
    monkeypatch.setenv("BIK_MOE_EXPERTS", "grouped")
    with pytest.raises(ValueError, match="BIK_MOE_EXPERTS='grouped'; expected one of"):
        bik.moe.experts_implementation()
    with pytest.raises(ValueError, match="implementation 'fused'"):
        bik.moe.experts(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, 1), torch.zeros(1, 2, 4), torch.zeros(1, 4, 1),
                        implementation="fused")
