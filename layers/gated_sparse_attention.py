"""`GatedSparseAttention`: the Gated Sparse Attention layer on the three GSA ops.

x -> q, k, v projections -> value gate v * sigmoid(W_g2 x) -> RoPE on q and k (rotate-half) -> the
gated lightning indexer on x (no RoPE) -> each query's top-k keys -> sparse attention over them ->
output gate o * sigmoid(W_g1 x) (per head and dim) -> o_proj.

`backend="registry"` runs the ops through `registry.get` (the tuned Triton kernels on a GPU; `vendor=`
forces one vendor's kernels, which on CPU tensors run in the Triton interpreter), and the elementwise
steps through the fused kernels of `kernels.common.gsa_layer`: RoPE of q and k and the value gate's
product in one pass, the output gate's product in another (each differentiable by its own backward
kernel); the indexer's three projections are one GEMM there. `backend="reference"` runs the same
module through the ops' PyTorch references and the plain PyTorch math below (RotaryEmbedding,
SigmoidGate), which is what the fused kernels are tested against. Both share one state_dict by
construction: the backend only decides which function runs each step. A plain CPU call of the registry
backend (no `vendor=`) runs the references, as the ops do.

Every step runs inside an NVTX range `gsa/<step>` (qkv_proj, value_gate, rotary_emb, indexer,
topk_select, sparse_attn, output_gate, o_proj), in that order with either backend, and the kernel
launchers add their own inside, so Nsight Systems and Nsight Compute show where the time goes
(benchmarks/gsa.py --profile, --ncu). With the fused kernels, `gsa/value_gate` holds the gate's
projection and `gsa/rotary_emb` the fused kernel, which also applies the value gate.
"""

from __future__ import annotations

import torch
from torch import nn

from kreg import registry
from kreg.core.nvtx import nvtx_range
from kreg.kernels.common.gsa_layer import output_gate, rope_value_gate
from kreg.ops import OPS
from kreg.ops.gsa_indexer import score_chunks

BACKENDS = ("registry", "reference")


class GatedLightningIndexer(nn.Module):
    """The indexer's projections of x: index queries [b, t, n_heads, d_indexer], one index key
    [b, t, d_indexer], per-head gate logits [b, t, n_heads], and a learned per-head score bias."""

    def __init__(self, d_model: int, d_indexer: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.d_indexer = n_heads, d_indexer
        self.idx_q_proj = nn.Linear(d_model, n_heads * d_indexer, bias=False)
        self.idx_k_proj = nn.Linear(d_model, d_indexer, bias=False)
        self.idx_w_proj = nn.Linear(d_model, n_heads, bias=False)
        self.idx_bias = nn.Parameter(torch.zeros(n_heads))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_idx, k_idx, w, bias) as gsa_indexer and gsa_topk take them."""
        b, t, _ = x.shape
        q_idx = self.idx_q_proj(x).view(b, t, self.n_heads, self.d_indexer)
        return q_idx, self.idx_k_proj(x), self.idx_w_proj(x), self.idx_bias

    @torch.no_grad()
    def selection_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`'s four tensors without autograd (the selection gets no gradient), from one GEMM of x
        with the three weights stacked: strided views of one [b, t, n] output. The stack is padded with
        zero rows to n a multiple of 16, so the views' token stride is 16-element aligned (and their starts
        too when n_heads * d_indexer and d_indexer are multiples of 16, as at the defaults): Triton
        vectorizes the top-k kernel's loads only then."""
        b, t, _ = x.shape
        n_q = self.n_heads * self.d_indexer
        weights = [self.idx_q_proj.weight, self.idx_k_proj.weight, self.idx_w_proj.weight]
        pad = -(n_q + self.d_indexer + self.n_heads) % 16
        if pad:
            weights.append(self.idx_q_proj.weight.new_zeros(pad, x.shape[-1]))
        out = torch.nn.functional.linear(x, torch.cat(weights))
        q_idx = out[..., :n_q].view(b, t, self.n_heads, self.d_indexer)
        k_idx = out[..., n_q:n_q + self.d_indexer]
        w = out[..., n_q + self.d_indexer:n_q + self.d_indexer + self.n_heads]
        return q_idx, k_idx, w, self.idx_bias.detach()


class SigmoidGate(nn.Module):
    """A gate sigmoid(W x) with one value per output feature (a head's dim, for every head)."""

    def __init__(self, d_model: int, features: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """W x, before the sigmoid (the fused kernels apply it)."""
        return self.gate_proj(x)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half convention, positions 0..t-1."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim: expected an even size for rotary embeddings, got {head_dim}")
        self.register_buffer("inv_freq", theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, t, h_q, d] and k [b, t, h_kv, d] rotated by their positions (computed in fp32)."""
        t = q.shape[1]
        angles = torch.arange(t, device=q.device, dtype=torch.float32)[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat([angles, angles], -1)[None, :, None, :]
        cos, sin = angles.cos(), angles.sin()
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        first, second = x32.chunk(2, -1)
        return (x32 * cos + torch.cat([-second, first], -1) * sin).to(x.dtype)


def adaptive_topk_length(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                         k: int, k_min: int, k_max: int) -> torch.Tensor:
    """Each query's key count k_i [b, t] int32 from the spread of its causal indexer scores (SPEC.md):
    var_i the population variance of query i's causal scores, vn_i = var_i / (mean over the sequence's
    positions of var + 1e-8), k_i = floor(k * (0.5 + 1 / (1 + vn_i))) clamped to [k_min, min(k_max, i + 1)].

    The scores come from the indexer's reference math a chunk of queries at a time (never [b, t, t]);
    every backend uses this one function, so they agree on k_i exactly."""
    sm_scale = q_idx.shape[-1] ** -0.5
    variances = []
    for start, scores in score_chunks(q_idx, k_idx, w, bias, sm_scale):
        causal = torch.isfinite(scores)
        count = torch.arange(start + 1, start + scores.shape[1] + 1, device=scores.device, dtype=scores.dtype)
        mean = torch.where(causal, scores, 0.0).sum(-1) / count
        centered = torch.where(causal, scores - mean[..., None], 0.0)
        variances.append(centered.square().sum(-1) / count)
    var = torch.cat(variances, 1)
    vn = var / (var.mean(1, keepdim=True) + 1e-8)
    k_i = torch.floor(k * (0.5 + 1.0 / (1.0 + vn)))
    positions = torch.arange(1, var.shape[1] + 1, device=var.device, dtype=var.dtype)
    upper = torch.clamp(positions, max=k_max)
    return torch.minimum(torch.clamp(k_i, min=k_min), upper).to(torch.int32)


class GatedSparseAttention(nn.Module):
    """Gated Sparse Attention (module docstring). Defaults: d_model 2048, 16 heads of 128 (16 kv heads),
    4 index heads of 64, k 2048.

    adaptive_k: each query's count k_i comes from its indexer scores (`adaptive_topk_length`), within
    [k_min, k_max], passed to gsa_topk and gsa_sparse_attention as topk_length over an index width of
    min(k_max, t); without it every query takes min(k, i + 1) keys.
    backend: "registry" or "reference" (same parameters either way); vendor: "nvidia" or "amd" forces
    that vendor's kernels for the registry backend (None: the tensors' device decides).
    """

    def __init__(self, d_model: int = 2048, n_heads: int = 16, n_kv_heads: int = 16, head_dim: int = 128,
                 d_indexer: int = 64, n_indexer_heads: int = 4, k: int = 2048, adaptive_k: bool = False,
                 k_min: int = 256, k_max: int = 4096, rope_theta: float = 10000.0, backend: str = "registry",
                 vendor: str | None = None) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads = {n_heads}, got {n_kv_heads}")
        for name, value in (("k", k), ("k_min", k_min), ("k_max", k_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if k_min > k_max:
            raise ValueError(f"k_min: expected at most k_max = {k_max}, got {k_min}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.k, self.adaptive_k, self.k_min, self.k_max = k, adaptive_k, k_min, k_max
        self.backend = backend
        self.vendor = vendor
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.value_gate = SigmoidGate(d_model, n_kv_heads * head_dim)
        self.output_gate = SigmoidGate(d_model, n_heads * head_dim)
        self.indexer = GatedLightningIndexer(d_model, d_indexer, n_indexer_heads)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_theta)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {value!r}")
        self._backend = value

    def _op(self, name: str):
        """The function that runs op `name` for this backend, with the op's own signature."""
        if self.backend == "registry":
            return registry.get(name, vendor=self.vendor)
        op = OPS[name]
        return lambda *args, **kwargs: op.reference(**op.validate(*args, **kwargs))

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the elementwise steps run the fused kernels: the registry backend on a GPU, or on CPU
        tensors with a forced vendor (the interpreter)."""
        return self.backend == "registry" and (x.device.type != "cpu" or self.vendor is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, t, d_model] -> [b, t, d_model]."""
        if x.dim() != 3 or x.shape[-1] != self.q_proj.in_features:
            raise ValueError(f"x: expected shape [b, t, {self.q_proj.in_features}], got {list(x.shape)}")
        b, t, _ = x.shape
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        fused = self._fused(x)
        with nvtx_range("gsa/qkv_proj"):
            q = self.q_proj(x).view(b, t, h, d)
            k = self.k_proj(x).view(b, t, h_kv, d)
            v = self.v_proj(x).view(b, t, h_kv, d)
        with nvtx_range("gsa/value_gate"):
            if fused:
                v_gate = self.value_gate.logits(x).view(b, t, h_kv, d)
            else:
                v = v * self.value_gate(x).view(b, t, h_kv, d)
        with nvtx_range("gsa/rotary_emb"):
            if fused:
                q, k, v = rope_value_gate(q, k, v, v_gate, self.rotary_emb.inv_freq, vendor=self.vendor)
            else:
                q, k = self.rotary_emb(q, k)
        with nvtx_range("gsa/indexer"):
            if fused:
                q_idx, k_idx, w, bias = self.indexer.selection_inputs(x)
            else:
                # Selection is not differentiable: the indexer gets no gradient through it.
                q_idx, k_idx, w, bias = (y.detach() for y in self.indexer(x))
            lengths = None
            if self.adaptive_k:
                lengths = adaptive_topk_length(q_idx, k_idx, w, bias, self.k, self.k_min, self.k_max)
        with nvtx_range("gsa/topk_select"):
            width = min(self.k_max if self.adaptive_k else self.k, t)
            indices = self._op("gsa_topk")(q_idx, k_idx, w, bias, width, topk_length=lengths)
        with nvtx_range("gsa/sparse_attn"):
            o = self._op("gsa_sparse_attention")(q, k, v, indices, topk_length=lengths)
        with nvtx_range("gsa/output_gate"):
            if fused:
                o = output_gate(o, self.output_gate.logits(x).view(b, t, h, d), vendor=self.vendor)
            else:
                o = o * self.output_gate(x).view(b, t, h, d)
        with nvtx_range("gsa/o_proj"):
            return self.o_proj(o.reshape(b, t, h * d))
