"""One MoE decoder layer written with torch alone: what the layer can cost with the kernels torch already has.

RMSNorm, a fused q/k/v projection, SDPA (flash attention on CUDA) with grouped query heads, the output
projection, RMSNorm, a softmax router in float32 with top-k and renormalized weights, the permute (an index
gather), two ``torch._grouped_mm`` expert GEMMs with SwiGLU between them, and the weighted un-permute
(``index_add``), forward and backward from a random output gradient (``../shared/gpu/layer_reference.py``, which
measured 12.9 ms on an H200 at Qwen3-30B-A3B's layer shape and 2 x 4096 tokens in bfloat16).

Two switches (:class:`ReferenceCase`) say how much of the project's layer it does:

* ``balanced``: every expert gets the same number of rows (a fixed random assignment of the token-slots; the router
  still runs for its cost), the grouped GEMMs' best case; otherwise the rows go where the router's top-k sends them,
  as in the project's layer;
* ``qk_norm_rope``: the per-head q and k RMSNorms and the rotary embedding of Qwen3 (rotate-half, the model's
  ``rope_theta``), which the project's layer runs and the original reference skipped.

It runs with torch's deterministic algorithms off (``index_add`` with atomics): the kernels' own speed, the floor
the project's layer is measured against (:func:`timed_case`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tim_megatron.recipe.schema import ModelDims


@dataclass(frozen=True)
class ReferenceCase:
    balanced: bool
    qk_norm_rope: bool

    @property
    def name(self) -> str:
        routing = "balanced routing" if self.balanced else "routed by its router"
        extra = "q/k norm + RoPE" if self.qk_norm_rope else "no q/k norm or RoPE"
        return f"{routing}, {extra}"


CASES = tuple(ReferenceCase(b, q) for q in (False, True) for b in (True, False))
"""The four cases, the original reference's (balanced, no q/k norm or RoPE) first."""
SAME_WORK = ReferenceCase(balanced=False, qk_norm_rope=True)
"""The case that does the project layer's work."""


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class ReferenceLayer:
    """The layer's weights and input for ``dims`` at ``sequences x length`` tokens (random, seeded), and its
    forward + backward (:meth:`step`)."""

    def __init__(
        self,
        dims: ModelDims,
        *,
        sequences: int,
        length: int,
        device: str,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ):
        d = dims
        self.B, self.S, self.H = sequences, length, d.hidden_size
        self.E, self.K, self.FF = d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size
        self.NH, self.KVH, self.HD = d.num_attention_heads, d.num_key_value_heads, d.head_dim
        self.eps, self.dtype, self.device = d.rms_norm_eps, dtype, device
        T = self.B * self.S
        g = torch.Generator(device="cpu").manual_seed(seed)

        def leaf(*shape, scale=0.02):
            t = torch.randn(*shape, generator=g) * scale
            return t.to(device=device, dtype=dtype).requires_grad_()

        self.ln1, self.ln2 = leaf(self.H, scale=1.0), leaf(self.H, scale=1.0)
        self.q_norm, self.k_norm = leaf(self.HD, scale=1.0), leaf(self.HD, scale=1.0)
        self.wqkv = leaf((self.NH + 2 * self.KVH) * self.HD, self.H)
        self.wo = leaf(self.H, self.NH * self.HD)
        self.wr = leaf(self.E, self.H)
        self.w1 = leaf(self.E, 2 * self.FF, self.H)
        self.w2 = leaf(self.E, self.H, self.FF)
        self.x0 = leaf(self.B, self.S, self.H, scale=1.0)
        self.g_out = torch.randn(self.B, self.S, self.H, generator=g).to(device=device, dtype=dtype)
        # balanced: row j of the permuted batch is token-slot perm[j]; every expert gets T*K/E rows
        self.perm = torch.randperm(T * self.K, generator=g).to(device)
        rows = T * self.K // self.E
        self.balanced_offs = (torch.arange(1, self.E + 1) * rows).to(device=device, dtype=torch.int32)
        self.balanced_offs[-1] = T * self.K
        inv = 1.0 / (d.rope_theta ** (torch.arange(0, self.HD, 2, dtype=torch.float32) / self.HD))
        freqs = torch.outer(torch.arange(self.S, dtype=torch.float32), inv)
        freqs = torch.cat((freqs, freqs), -1).to(device)  # [S, HD]
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def leaves(self) -> list[torch.Tensor]:
        names = ("ln1", "ln2", "q_norm", "k_norm", "wqkv", "wo", "wr", "w1", "w2", "x0")
        return [getattr(self, n) for n in names]

    def forward(self, case: ReferenceCase) -> torch.Tensor:
        B, S, H, T = self.B, self.S, self.H, self.B * self.S
        h = _rms(self.x0, self.ln1, self.eps)
        qkv = F.linear(h, self.wqkv).view(B, S, self.NH + 2 * self.KVH, self.HD).transpose(1, 2)
        q, k, v = qkv.split([self.NH, self.KVH, self.KVH], dim=1)
        if case.qk_norm_rope:
            q, k = _rms(q, self.q_norm, self.eps), _rms(k, self.k_norm, self.eps)
            q = q * self.cos + _rotate_half(q) * self.sin
            k = k * self.cos + _rotate_half(k) * self.sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = self.x0 + F.linear(a.transpose(1, 2).reshape(B, S, self.NH * self.HD), self.wo)
        h = _rms(x, self.ln2, self.eps).view(T, H)
        probs = torch.softmax(F.linear(h, self.wr).float(), -1)
        top_w, top_e = probs.topk(self.K, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(self.dtype)
        if case.balanced:
            slot, offs = self.perm, self.balanced_offs
        else:
            experts = top_e.reshape(-1)
            slot = torch.argsort(experts, stable=True)
            counts = torch.zeros(self.E, dtype=torch.int32, device=h.device)
            counts.scatter_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = slot // self.K
        y = torch._grouped_mm(h[token], self.w1.transpose(-2, -1), offs=offs)
        gate, up = y.chunk(2, -1)
        y = torch._grouped_mm((F.silu(gate) * up).contiguous(), self.w2.transpose(-2, -1), offs=offs)
        weighted = y * top_w.reshape(-1)[slot].unsqueeze(-1)
        moe = torch.zeros(T, H, device=h.device, dtype=self.dtype).index_add(0, token, weighted)
        return x + moe.view(B, S, H)

    def step(self, case: ReferenceCase) -> None:
        """Forward and backward (the gradients of every weight and of the input), gradients dropped first."""
        for t in self.leaves():
            t.grad = None
        self.forward(case).backward(self.g_out)


def timed_case(layer: ReferenceLayer, case: ReferenceCase, *, repeat: int = 5, warm: int = 2) -> float:
    """Median seconds of ``layer.step(case)`` (the device synchronized around each), with torch's deterministic
    algorithms off meanwhile (their setting is restored after)."""
    cuda = layer.device.startswith("cuda")
    det, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(False)
    try:
        for _ in range(warm):
            layer.step(case)
        times = []
        for _ in range(repeat):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            layer.step(case)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
