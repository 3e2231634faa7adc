"""What the attention family's Hopper Gluon kernels share (kernels/nvidia/attention_warpspec.py, the
forward; kernels/nvidia/attention_warpspec_bwd.py, the dK/dV and dQ backward; attention_window.py, the
short-window forward): TMA descriptors over [b, s, h, d] tensors with blocks of rows of one head, the
check that TMA can address a tensor at all, the JIT signature type of such a descriptor (for offline
compiles), the outputs a forward allocates, and the warp roles' common pieces (the producer's register
budget, a warpgroup's arrival on an mbarrier, the query tile a program owns and the key tiles its rows
may see)."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# A producer only issues TMA copies and waits on barriers: the fewest registers setmaxnreg allows.
PRODUCER_REGS = gl.constexpr(24)
_ELEMENT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@gluon.jit
def release(bar):
    """One arrival for this warpgroup, after all of its warps are past what came before."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def query_tile(IS_CAUSAL: gl.constexpr):
    """This program's query tile (grid axis 0): causal grids start with the last tiles (they see the
    most keys), so the short ones fill the tail."""
    tile = gl.program_id(0)
    if IS_CAUSAL:
        tile = gl.num_programs(0) - 1 - tile
    return tile


@gluon.jit
def key_tiles(m0, rows, seqlen_q, seqlen_k, IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles [0, n) that query rows [m0, m0 + rows) may see (query i sits at s_k - s_q + i)."""
    hi = seqlen_k
    if IS_CAUSAL:
        p_last = seqlen_k - seqlen_q + gl.minimum(m0 + rows, seqlen_q) - 1
        hi = gl.minimum(hi, gl.maximum(p_last + 1, 0))
    return gl.cdiv(hi, BLOCK_N)


@functools.cache
def _block_layout(rows: int, head_dim: int, elem: str, heads: int = 1) -> gl.NVMMASharedLayout:
    """The shared layout of one [1, rows, heads, head_dim] TMA block (128-byte swizzle at d 64 and 128);
    cached, since every call builds several descriptors (building it was most of a descriptor's host
    time)."""
    element = gl.bfloat16 if elem == "bf16" else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, rows, heads, head_dim], element)


@functools.lru_cache(maxsize=1024)  # on every call's host path: a process sees few distinct layouts
def _tma_strides(shape: tuple, strides: tuple, elem: int) -> tuple | None:
    """The strides a descriptor over a tensor of this layout takes, those of size-1 dims (never stepped
    over, and free to be anything in torch) set to what a packed layout would give them; None when TMA
    cannot address the layout: every stride but the last (which the contract makes 1) must be a
    positive multiple of 16 bytes (an expanded, stride-0 dim is not one)."""
    strides = list(strides)
    if 1 in shape:
        for i in range(len(shape) - 2, -1, -1):
            if shape[i] == 1:
                strides[i] = strides[i + 1] * shape[i + 1]
    if not all(stride > 0 and stride * elem % 16 == 0 for stride in strides[:-1]):
        return None
    return tuple(strides)


@functools.lru_cache(maxsize=1024)  # on every call's host path: a process sees few distinct layouts
def _descriptor_fields(shape: tuple, strides: tuple, dtype: torch.dtype, rows: int, heads: int) -> dict:
    """A descriptor's fields but its base, for a tensor of this layout and blocks of `rows` rows of
    `heads` heads. Descriptors of one layout share these lists: nothing writes them after this."""
    d = shape[-1]
    return {"shape": list(shape), "strides": list(_tma_strides(shape, strides, dtype.itemsize)),
            "block_shape": [1, rows, heads, d], "layout": _block_layout(rows, d, _ELEMENT_NAMES[dtype], heads),
            "padding": "zero"}


def descriptor(t: torch.Tensor, rows: int, heads: int = 1) -> TensorDescriptor:
    """A TMA descriptor over a [b, s, h, d] tensor whose blocks are `rows` rows of `heads` consecutive
    heads (token-major), for a tensor `tma_addressable` accepted (the contracts make every dimension
    non-empty and the last contiguous).

    Made without the dataclass's own checks, which would repeat those on every call (a third of a
    descriptor's host time; a launcher builds four to six per call), from fields kept per layout."""
    made = object.__new__(TensorDescriptor)
    made.__dict__.update(_descriptor_fields(t.shape, t.stride(), t.dtype, rows, heads))
    made.base = t
    return made


@functools.lru_cache(maxsize=256)  # on every call's host path: a plan's launches take a few block shapes
def descriptor_makers(*blocks: tuple[int, int]) -> tuple:
    """The (position, make descriptor from tensor) pairs `launch.tma_launch` takes for a kernel whose
    first parameters are descriptors: parameter i gets `descriptor(t, rows, heads)` with
    `blocks[i] = (rows, heads)`."""
    return tuple((i, functools.partial(descriptor, rows=rows, heads=heads)) for i, (rows, heads) in enumerate(blocks))


def padded_outputs(q: torch.Tensor, keep_lse: bool, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out like a padded [b, s, h, d] q, and lse [b, h, s] in fp32 when it is returned or kept for a
    backward (None otherwise): what the Gluon forwards write."""
    batch, s_q, h_q, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, h_q, s_q), dtype=torch.float32, device=q.device) if keep_lse or return_lse else None
    return out, lse


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether TMA can address `t`: a 16-byte aligned base and a layout `_tma_strides` accepts."""
    return t.data_ptr() % 16 == 0 and _tma_strides(t.shape, t.stride(), t.element_size()) is not None


def tma_addressable_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """`tma_addressable` of q, k and v (of one element type, as the contracts make them), their three
    layouts checked in one cached lookup: a forward's host path asks on every call."""
    return (not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
            and _qkv_layouts_addressable(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
                                         q.element_size()))


@functools.lru_cache(maxsize=1024)
def _qkv_layouts_addressable(q_shape: tuple, q_strides: tuple, k_shape: tuple, k_strides: tuple, v_shape: tuple,
                             v_strides: tuple, elem: int) -> bool:
    return all(_tma_strides(shape, strides, elem) is not None
               for shape, strides in ((q_shape, q_strides), (k_shape, k_strides), (v_shape, v_strides)))
