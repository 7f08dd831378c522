"""The training side of ``bik rl``: the checkpoint's Hugging Face causal LM (dense or a mixture
of experts, ``AutoModelForCausalLM``) as a trainer runs it (train mode, grad on), its logprobs
of the sampled tokens from one packed batch, a GRPO loss, backward and AdamW on fp32 master
weights; the weights handed to the engine under the checkpoint's own names.

The logprob of token t at temperature T is ``log_softmax(logits.float() / T)[t]``: the division
after the upcast, as vLLM divides its fp32 logits (dividing bf16 logits first gives other
bits). Under bik.enable() it is bik.log_softmax, the sampler's normaliser: the engine's
processed logprob bit for bit.
"""

from __future__ import annotations

import hashlib
import os

import torch

from bik.ops.sampling.kept import kept_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def packed_logprobs(model, sequences: list[list[int]], targets: list[list[int]],
                    temperatures: list[float], position_ids: torch.Tensor | None, *,
                    top_k: int = 0, top_p: float = 1.0) -> list[torch.Tensor]:
    """Each sequence's logprobs of its targets (the tokens after its prompt), from one forward
    of all sequences packed into one row. ``position_ids`` must restart at 0 per sequence:
    without them a packed row is one long sequence whose tokens attend across sequences, and
    ValueError says so. With top-k / top-p, of the filtered distribution the engine drew from:
    the tokens bik.sample drops at -inf (ops/sampling/kept.py). fp32 [len(targets[i])] each,
    with grad."""
    if len(sequences) > 1 and position_ids is None:
        raise ValueError("bik rl: a packed batch of several sequences needs position_ids "
                         "restarting at 0 per sequence (transformers then keeps each sequence "
                         "to itself); got none")
    ids = torch.tensor([sum(sequences, [])])
    hidden = model.model(ids, position_ids=position_ids, use_cache=False).last_hidden_state[0]
    # The LM head on the rows that predict a target only (about a third of a rollout's rows:
    # its cost is most of the step's). A row's logits do not depend on which rows go with it
    # under bik; stock they may, which is part of what the control measures.
    rows, start = [], 0
    for seq, tgt in zip(sequences, targets):
        rows.append(torch.arange(start + len(seq) - len(tgt) - 1, start + len(seq) - 1))
        start += len(seq)
    logits = model.lm_head(hidden[torch.cat(rows)])
    out, at = [], 0
    for tgt, t in zip(targets, temperatures):
        z = logits[at:at + len(tgt)].float()
        z = z / t if t > 0 else z
        if top_k > 0 or top_p < 1.0:
            rows_here = len(tgt)
            kept = kept_tokens(z.detach(), torch.full((rows_here,), top_k),
                               torch.full((rows_here,), top_p))
            z = z.masked_fill(~kept, float("-inf"))
        lp = torch.log_softmax(z, -1)
        out.append(lp.gather(1, torch.tensor(tgt, dtype=torch.int64)[:, None])[:, 0])
        at += len(tgt)
    return out


def positions(sequences: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(len(s)) for s in sequences])[None]


def grpo_loss(logprobs: list[torch.Tensor], old: list[torch.Tensor], advantages: list[float],
              clip: float = 0.2) -> torch.Tensor:
    """GRPO's clipped objective, negated: per sequence the mean over its tokens of
    min(rho * A, clip(rho, 1 - clip, 1 + clip) * A), rho = exp(logprob - old logprob), then the
    mean over sequences. ``old`` are the engine's logprobs: rho is exactly 1 when the trainer
    computes the engine's function (bik), and the gradient is the policy gradient itself."""
    terms = []
    for lp, lp_old, a in zip(logprobs, old, advantages):
        if lp.numel() == 0:
            continue
        rho = torch.exp(lp - lp_old)
        terms.append(torch.minimum(rho * a, rho.clamp(1 - clip, 1 + clip) * a).mean())
    return -torch.stack(terms).mean()


def advantages(rewards: list[float], group: int) -> list[float]:
    """Each completion's reward minus its group's mean, over the group's std (+1e-4)."""
    r = torch.tensor(rewards, dtype=torch.float64).reshape(-1, group)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)
    return a.flatten().tolist()


def checkpoint_shapes(model_dir: str) -> dict[str, torch.Size]:
    """Every tensor's name and shape in the directory's safetensors files (headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes |= {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}
    if not shapes:
        raise ValueError(f"bik rl: no safetensors weights in {model_dir}")
    return shapes


class Trainer:
    """fp32 master weights with AdamW; the forward runs on them (float32) or on a bf16 copy
    (bfloat16), whose gradients are accumulated into the masters in fp32."""

    def __init__(self, model_dir: str, dtype: str, lr: float):
        import transformers

        from bik import moe

        self.model_dir = model_dir
        # a mixture of experts' experts as the engine computes them: BIK_MOE_EXPERTS when set
        # (a dense model refuses any setting, in transformers' words), else transformers'
        # default, grouped_mm, which is the engine's default too
        load = ({"experts_implementation": moe.experts_implementation()}
                if os.environ.get(moe.EXPERTS_ENV) else {})
        self.master = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **load)
        self.dtype = DTYPES[dtype]
        self.model = self.master
        if self.dtype != torch.float32:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=self.dtype, **load)
            self._copy_masters()
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=lr)

    def _copy_masters(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.master.parameters()):
                p.copy_(m)

    def expected(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """What a weight update must hold: the checkpoint's names and shapes (what the engine
        loaded; read from the files, not from the converter), in the forward's dtype."""
        return {n: (shape, self.dtype) for n, shape in checkpoint_shapes(self.model_dir).items()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The forward model's weights under the checkpoint's names (a tied LM head appears
        once). transformers 5 keeps a mixture of experts' weights fused ([E, 2I, H] gate and
        up, [E, H, I] down) where checkpoints, and vLLM's loader, name them per expert: its
        own save-time conversion splits them back."""
        from transformers.core_model_loading import revert_weight_conversion

        named = {n: p.detach() for n, p in self.model.named_parameters()}
        return revert_weight_conversion(self.model, named)

    def logprobs(self, sequences, targets, temperatures, **filters) -> list[torch.Tensor]:
        return packed_logprobs(self.model, sequences, targets, temperatures,
                               positions(sequences), **filters)

    def step(self, loss: torch.Tensor) -> tuple[str, float]:
        """Backward, AdamW on the masters, the forward copy refreshed. Returns the sha256 of
        every gradient's bytes (in parameter order: equal digests, equal gradients) and the
        gradients' global L2 norm."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.model is not self.master:
            self.model.zero_grad(set_to_none=True)
        loss.backward()
        digest, square = hashlib.sha256(), 0.0
        for p, m in zip(self.model.parameters(), self.master.parameters()):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            digest.update(grad.contiguous().view(torch.uint8).numpy().tobytes())
            square += float(grad.double().square().sum())
            if m is not p:
                m.grad = grad.float()
        self.optimizer.step()
        if self.model is not self.master:
            self._copy_masters()
        return digest.hexdigest()[:16], square ** 0.5
