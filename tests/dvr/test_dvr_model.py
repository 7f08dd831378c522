"""bik.dvr's Llama model: HF parity, exact batch invariance on bik kernels, checkpoint errors.

Invariance is asserted with exact bit equality, and every invariance harness is also run on a
kernel set that must fail it (the stock fast path, or a deliberately batch-dependent one).
"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from bik.dvr.checkpoint import CheckpointError
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.model import (
    LlamaConfig,
    embedded_config,
    embedded_model,
    llama_1b_config,
    load_checkpoint,
    swiglu,
)
from bik.dvr.rope import inverse_frequencies
from bik.dvr.step import KVCache, build_step
from bik.runtime import cpu_ext
from bik.testing import same_bits
from bik.testing.controls import split_by_m_matmul

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

# c in: max|ours - HF fp64| <= c * max|HF fp32 - HF fp64| (logits, fp32 weights). Measured over
# the 4 configs below x 3 seeds: c <= 1.43 on bik kernels, <= 1.22 on the fast path (HF fp32's
# own error was 1.7e-6 .. 2.3e-6 on logits of magnitude ~3). Asserted with headroom:
ERROR_RATIO = 2.0


# ---- helpers ---------------------------------------------------------------------------------

def hf_llama(tmp_path, *, tie=False, rope_scaling=None, shard=False, seed=0):
    """A tiny random transformers Llama saved to tmp_path; returns (hf model, directory)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=120, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=tie, initializer_range=0.1,
        rope_theta=500000.0 if rope_scaling else 10000.0, rope_scaling=rope_scaling,
        bos_token_id=1, eos_token_id=[2, 3])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    return model, tmp_path


def tokens_for(n, vocab, seed):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


class Runner:
    """Feeds sequences through model.forward step by step, with its own cache and blocks."""

    def __init__(self, model, kernels, *, block_size=4, num_blocks=96, block_order=None):
        self.model, self.kernels, self.block_size = model, kernels, block_size
        self.cache = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, "cpu")
        self.free = list(range(num_blocks) if block_order is None else block_order)
        self.blocks: dict = {}
        self.lens: dict = {}

    def step(self, work):
        """work: [(sequence id, new tokens [n])]; returns {sequence id: logits [n, V]}."""
        q_lens, kv_lens, block_lists, positions = [], [], [], []
        for sid, toks in work:
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop(0))
            q_lens.append(len(toks))
            kv_lens.append(end)
            block_lists.append(list(blocks))
            positions.append(torch.arange(start, end))
            self.lens[sid] = end
        step = build_step(q_lens, kv_lens, block_lists, self.block_size)
        tokens = torch.cat([toks for _, toks in work])
        logits = self.model.forward(tokens, torch.cat(positions), step, self.cache, self.kernels)
        return dict(zip([sid for sid, _ in work], logits.split(q_lens)))

    def run(self, seq, chunks):
        """Feed one sequence alone in chunks of the given sizes; its logits [len, V]."""
        out, start = [], 0
        for n in chunks:
            out.append(self.step([("s", seq[start:start + n])])["s"])
            start += n
        return torch.cat(out)


class SplitByMKernels(FastKernels):
    """Deliberately batch-dependent: the matmul's K split is chosen by the number of rows."""

    name = "split-by-m"

    def linear(self, x, w):
        return split_by_m_matmul(x, w.t())


class PagewiseAttention(BikKernels):
    """Deliberately page-size-dependent attention: softmax sums folded page by page."""

    def attention(self, q, k_cache, v_cache, step, scale):
        page, hkv, d = k_cache.shape[1:]
        flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        out, start = torch.empty_like(q), 0
        for b, (q_len, kv_len) in enumerate(zip(step.q_lens, step.kv_lens)):
            pos = torch.arange(kv_len)
            slots = step.block_table[b, pos // page].long() * page + pos % page
            k = flat_k[slots].repeat_interleave(q.shape[1] // hkv, 1).transpose(0, 1)
            v = flat_v[slots].repeat_interleave(q.shape[1] // hkv, 1).transpose(0, 1)
            qb = q[start:start + q_len].transpose(0, 1)
            s = qb @ k.transpose(1, 2) * scale
            rows = torch.arange(kv_len - q_len, kv_len)
            s = s.masked_fill(pos[None, :] > rows[:, None], float("-inf"))
            p = torch.exp(s - s.amax(-1, keepdim=True))
            den = sum(p[..., i:i + page].sum(-1) for i in range(0, kv_len, page))
            acc = sum(p[..., i:i + page] @ v[:, i:i + page] for i in range(0, kv_len, page))
            out[start:start + q_len] = (acc / den[..., None]).transpose(0, 1)
            start += q_len
        return out


def count_diff(a, b):
    return int((a != b).sum())


@pytest.fixture(scope="module")
def model():
    return embedded_model(seed=0)


@pytest.fixture(scope="module")
def seq(model):
    return tokens_for(19, model.config.vocab_size, seed=5)


# ---- parity with transformers ------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # head_dim 16, theta 5e5: all three bands


@pytest.mark.parametrize("tie,rope_scaling,shard", [
    pytest.param(False, None, False, id="untied"),
    pytest.param(True, None, False, id="tied"),
    pytest.param(False, LLAMA3, True, id="llama3-rope-sharded"),
    pytest.param(True, LLAMA3, False, id="llama3-rope-tied"),
])
def test_logits_match_transformers(tmp_path, tie, rope_scaling, shard):
    hf, path = hf_llama(tmp_path, tie=tie, rope_scaling=rope_scaling, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    ours = load_checkpoint(path)
    assert ours.config.tie_word_embeddings == tie
    assert ours.config.eos_token_ids == (2, 3)
    assert (ours.lm_head is ours.embed) == tie
    assert torch.equal(inverse_frequencies(ours.config), hf.model.rotary_emb.inv_freq)
    ids = tokens_for(40, 256, seed=1)
    with torch.no_grad():
        hf32 = hf(ids[None]).logits[0]
        hf64 = hf.double()(ids[None]).logits[0]
    for kernels in (BikKernels(), FastKernels()):
        # Two chunks (a prefill, then a verify-sized window) through the paged cache.
        got = Runner(ours, kernels).run(ids, [33, 7])
        err, hf_err = (got.double() - hf64).abs().max(), (hf32.double() - hf64).abs().max()
        assert hf_err > 0
        assert err <= ERROR_RATIO * hf_err, (kernels.name, float(err), float(hf_err))
    assert not torch.equal(got, hf32)  # our kernels really ran


def test_config_reads_hub_spelling():
    """Checkpoints on the Hub use rope_theta + rope_scaling (Llama-3.2-1B's config.json)."""
    d = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
         "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
         "tie_word_embeddings": True, "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009],
         "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert LlamaConfig.from_hf_dict(d) == llama_1b_config()
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        LlamaConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf_dict({**d, "attention_bias": True})


# ---- checkpoint errors -----------------------------------------------------------------------

def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    _, path = hf_llama(tmp_path / "m")
    weights = path / "model.safetensors"
    config = json.loads((path / "config.json").read_text())

    (path / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                  "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a Llama checkpoint.*mistral"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps(config))

    from safetensors.torch import load_file, save_file
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              weights)
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_checkpoint(path)
    save_file({**tensors, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, weights)
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*layers\.2\.mlp\.up_proj"):
        load_checkpoint(path)
    save_file({**tensors, "model.norm.weight": torch.ones(65)}, weights)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \[65\]"):
        load_checkpoint(path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(path)


# ---- exact invariance on bik kernels (and controls that must fail) -----------------------------

def chunking_diffs(model, kernels, seq):
    """Differing logits between a whole prefill and (chunks | one token at a time)."""
    whole = Runner(model, kernels).run(seq, [len(seq)])
    chunks = Runner(model, kernels).run(seq, [5, 1, 8, 5])
    decode = Runner(model, kernels).run(seq, [1] * len(seq))
    return count_diff(whole, chunks), count_diff(whole, decode)


def test_chunking_invariance(model, seq):
    assert chunking_diffs(model, BikKernels(), seq) == (0, 0)
    # Control, measured: stock CPU fp32 mm computes a one-token step (M = 1) differently from
    # the 19-row prefill: 9087 of 9728 decode logits and 8471 of 9728 chunked logits differ.
    fast_chunks, fast_decode = chunking_diffs(model, FastKernels(), seq)
    assert fast_chunks > 0 and fast_decode > 0, "the stock fast path no longer differs"


def neighbour_diffs(model, kernels, seq):
    """Differing logits of ``seq`` alone vs in batches with other sequences of other lengths,
    at every row position of the batch, over a prefill and mixed decode / chunk steps."""
    vocab = model.config.vocab_size
    prompt, steps = seq[:11], [seq[11:12], seq[12:13], seq[13:17]]
    alone = Runner(model, kernels).run(seq[:17], [11, 1, 1, 4])
    others = {f"n{i}": tokens_for(n, vocab, seed=10 + i) for i, n in enumerate((3, 17, 6))}
    # Per step: how many new tokens each neighbour feeds (prefill chunks and decodes mixed).
    plan = [(3, 9, 6), (0, 8, 0), (0, 0, 0), (0, 0, 0)]
    diffs = 0
    for row in range(len(others) + 1):
        runner = Runner(model, kernels)
        fed = {name: 0 for name in others}
        got = []
        for ours, counts in zip([prompt, *steps], plan):
            work = []
            for (name, toks), n in zip(others.items(), counts):
                # A neighbour with nothing left to prefill decodes one token.
                n = n or 1
                work.append((name, toks[fed[name]:fed[name] + n] if fed[name] + n <= len(toks)
                             else tokens_for(n, vocab, seed=99)))
                fed[name] += n
            work.insert(row, ("s", ours))
            got.append(runner.step(work)["s"])
        diffs += count_diff(alone, torch.cat(got))
    return diffs


def test_neighbour_invariance(model, seq):
    assert neighbour_diffs(model, BikKernels(), seq) == 0
    # Controls: the fast path's decode rows run at M = 1 alone and M >= 4 batched (measured:
    # 17033 of 34816 logits differ); a matmul whose split follows M: 32128 of 34816.
    assert neighbour_diffs(model, FastKernels(), seq) > 0
    assert neighbour_diffs(model, SplitByMKernels(), seq) > 0


def layout_diffs(model, kernels, seq):
    """Differing logits across block sizes and block placements (token-by-token tail)."""
    chunks = [7, 1, 1, 10]
    ref = Runner(model, kernels, block_size=16).run(seq, chunks)
    diffs = 0
    for block_size, order in [(1, None), (4, None), (4, range(95, -1, -1)), (5, range(1, 96, 2)),
                              (32, [3, 0, 1])]:
        runner = Runner(model, kernels, block_size=block_size, block_order=order)
        diffs += count_diff(ref, runner.run(seq, chunks))
    return diffs


def test_cache_layout_invariance(model, seq):
    assert layout_diffs(model, BikKernels(), seq) == 0
    # Control: softmax sums folded page by page (measured: 30188 of 48640 logits differ).
    assert layout_diffs(model, PagewiseAttention(), seq) > 0


def test_logits_rows(model, seq):
    full = Runner(model, BikKernels()).run(seq, [len(seq)])
    runner = Runner(model, BikKernels())
    step = build_step([19], [19], [list(range(5))], 4)
    rows = torch.tensor([18, 3])
    got = model.forward(seq, torch.arange(19), step, runner.cache, BikKernels(), logits_rows=rows)
    assert same_bits(got, full[rows])


def test_swiglu_is_row_invariant():
    """Rows of 172 gate values straddle the SIMD steps (16 floats on AVX2, 32 on AVX-512)
    differently alone and in a batch; swiglu's bits must not move, while torch's silu (scalar
    tail) does (measured on AVX2: 14 of 37 rows)."""
    gu = torch.randn(37, 344, generator=torch.Generator().manual_seed(0)) * 3

    def silu_stock(x):
        return F.silu(x[:, :172].contiguous()) * x[:, 172:]

    for fn, expect_equal in ((swiglu, True), (silu_stock, False)):
        full = fn(gu)
        rows_equal = all(same_bits(fn(gu[r:r + 1]), full[r:r + 1]) for r in range(37))
        assert rows_equal == expect_equal, fn


# ---- the embedded model ----------------------------------------------------------------------

def greedy(model, prompt, n):
    runner = Runner(model, BikKernels())
    logits = runner.step([("s", prompt)])["s"]
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.step([("s", torch.tensor(out[-1:]))])["s"]
    return out


def test_embedded_model_is_seeded_and_not_degenerate(model):
    again, other = embedded_model(seed=0), embedded_model(seed=1)
    assert model.config == embedded_config() and model.config.eos_token_ids == (2,)
    assert same_bits(model.embed, again.embed) and same_bits(model.layers[1].down,
                                                              again.layers[1].down)
    assert not torch.equal(model.embed, other.embed)
    out = greedy(model, tokens_for(8, 512, seed=0), 48)
    assert out == greedy(again, tokens_for(8, 512, seed=0), 48)
    assert len(set(out)) >= 16, out  # measured: 46 distinct tokens of 48
    assert len(set(out[-16:])) >= 4, out


def test_forward_input_errors(model):
    runner = Runner(model, BikKernels())
    step = build_step([3], [3], [[0]], 4)
    with pytest.raises(ValueError, match="tokens must be int64"):
        model.forward(torch.tensor([1, 2, 3], dtype=torch.int32), torch.arange(3), step,
                      runner.cache, BikKernels())
    with pytest.raises(ValueError, match="2 tokens but the step packs 3"):
        model.forward(torch.tensor([1, 2]), torch.arange(2), step, runner.cache, BikKernels())
    with pytest.raises(ValueError, match="not the step's"):
        model.forward(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), step, runner.cache,
                      BikKernels())
    half = KVCache.allocate(model.config, 4, 4, torch.float64, "cpu")
    with pytest.raises(TypeError, match="cache dtype"):
        model.forward(torch.tensor([1, 2, 3]), torch.arange(3), step, half, BikKernels())


def test_build_step():
    step = build_step([2, 1, 0], [5, 1, 4], [[7, 2], [4], [1]], 4)
    assert step.cu_seqlens_q.tolist() == [0, 2, 3, 3]
    assert step.cache_seqlens.tolist() == [5, 1, 4] and step.kv_lens == (5, 1, 4)
    assert step.block_table.tolist() == [[7, 2], [4, 0], [1, 0]]
    assert step.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 0]
    assert step.slot_mapping.dtype == torch.int64 and step.block_table.dtype == torch.int32
    with pytest.raises(ValueError, match="blocks of 4 hold 4"):
        build_step([1], [5], [[0]], 4)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        build_step([3], [2], [[0]], 4)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        dataclasses.replace(embedded_config(), num_key_value_heads=3)
