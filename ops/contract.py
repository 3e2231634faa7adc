"""What every op file declares, the argument checks they share, and shared reference helpers.

An op file (`ops/<op>.py`) builds one `Op` at import time: its validation, its PyTorch
reference, its tuning key and cost model, and the shapes sweeps and benchmarks use. It knows nothing of
Triton or vendors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# Tuning keys and tables name dtypes by these short strings.
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# A frozenset: membership is one hash lookup on the hot path.
FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))


class TensorSpec(NamedTuple):
    """The shape and dtype of one output tensor, as `Op.output_specs` describes it."""

    shape: tuple
    dtype: torch.dtype


def spec_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
    """The spec of an output shaped like `t` (in `t`'s dtype unless given)."""
    return TensorSpec(tuple(t.shape), t.dtype if dtype is None else dtype)


class Args(dict):
    """Validated arguments by name, plus `key`: a cheap hashable summary of everything the tuning key
    depends on (raw shapes, dtype, flags), built from what validation already read, so the dispatch
    hot path finds its cached launcher without reading the tensors again."""

    __slots__ = ("key",)


@dataclass(frozen=True)
class Op:
    """An op contract.

    validate(*args, **kwargs) -> dict: has the op's public signature and its docstring is the op's
        contract (what `registry.describe` prints); takes the user's call as that signature reads,
        raises ValueError/TypeError naming the argument, and returns every argument by name with
        defaults resolved (sm_scale filled in). This dict is what references and variants receive;
        an op on a hot path returns an `Args` whose `key` lets dispatch skip `tuning_key`.
    reference(**args): the semantics, in PyTorch; kernels are right when they match it.
    tuning_key(args) -> tuple: hashable (name, value) pairs that pick a config (sequence lengths
        bucketed); cheap, since it runs on every call.
    flops(args), bytes_moved(args): the cost model benchmarks and sweeps report against.
    make_inputs(shape, device=, dtype=, seed=) -> dict: fresh random arguments by name for a preset
        shape dict (never zeros).
    presets: named lists of shape dicts; "tiny" runs in the interpreter, "full" on a GPU (docs/performance.md).
    reduce_shape(shape) -> shape: a shape with the same heads, head dims and top-k whose reference
        fits in memory, for the correctness gate of a sweep.
    outputs: names of the returned tensors, in order (a single tensor op has one name).
    length_dims: the tuning-key dims that are bucketed lengths; a key never tuned may borrow the
        config of the nearest tuned key that differs only in these (the store knows no dim names).
    layouts(shape) -> [shape, ...]: the shape as each layout the contract accepts spells it (batched
        and not, packed varlen, ...), all with one tuning key: a tuned config serves every layout.
    grad_inputs: the arguments gradients flow to, for a differentiable op (empty: not differentiable);
        a backward gets the gradient of its first output.
    output_specs(args) -> what a call returns with each tensor replaced by its `TensorSpec`: one
        spec, or a tuple (or NamedTuple) of them in `outputs` order, from shapes and flags only (no
        tensor values). It is the op's fake implementation under torch.compile (registry/library.py);
        the tensors live on the device of the first argument and are contiguous. `args` has
        validate's parameters by name with defaults filled in but unvalidated (sm_scale may be None).
    error(actual, expected, args) -> float: how far an output is from the reference's, on the scale of
        `ops.testing.TOLERANCE`, for an op whose outputs cannot be compared element by element (an
        unordered selection); None: `ops.testing.max_relative_error`.
    specializations(args) -> [args, ...]: validated arguments of the calls one tuning key serves whose
        kernels specialize differently (an optional input given, a flag that changes a kernel's
        constexprs but not the key), `args` first. The offline compile check compiles what each of
        them launches, so a config is checked for every such call; it runs them on "meta" tensors, so
        an added input needs the right shape and dtype, not data (zeros keep it valid anywhere).
    """

    name: str
    summary: str
    validate: Callable[..., dict]
    reference: Callable[..., Any]
    tuning_key: Callable[[dict], tuple]
    flops: Callable[[dict], float]
    bytes_moved: Callable[[dict], float]
    make_inputs: Callable[..., dict]
    presets: Mapping[str, Sequence[dict]]
    reduce_shape: Callable[[dict], dict] = field(default=lambda shape: dict(shape))
    outputs: tuple[str, ...] = ("out",)
    length_dims: tuple[str, ...] = ()
    layouts: Callable[[dict], list[dict]] = field(default=lambda shape: [dict(shape)])
    grad_inputs: tuple[str, ...] = ()
    output_specs: Callable[[dict], Any] | None = None
    error: Callable[[Any, Any, dict], float] | None = None
    specializations: Callable[[dict], list[dict]] = field(default=lambda args: [args])

    @property
    def differentiable(self) -> bool:
        return bool(self.grad_inputs)

    def all_outputs(self, result: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A call's result as every output of `outputs`, in order; an empty fp32 tensor stands for one the
        call does not return (lse without return_lse). What a variant's backward receives."""
        tensors = [result] if isinstance(result, torch.Tensor) else list(result)
        return (*tensors, *(empty_output(device) for _ in range(len(self.outputs) - len(tensors))))


def empty_output(device: torch.device) -> torch.Tensor:
    """What stands for an output (or a gradient) that a call does not have."""
    return torch.empty(0, dtype=torch.float32, device=device)


# Elements of temporaries a reference holds per query chunk (2^25 fp32: 128 MiB), which bounds its
# memory at the large preset shapes.
REFERENCE_CHUNK_ELEMS = 1 << 25


def query_chunk(elems_per_row: int) -> int:
    """Query rows a reference processes at once, given the elements of temporaries each row needs
    (counted by the caller): as many as REFERENCE_CHUNK_ELEMS holds, at least one."""
    return max(1, REFERENCE_CHUNK_ELEMS // max(1, elems_per_row))


def bucket_pow2(n: int, lo: int = 16, hi: int = 1 << 20) -> int:
    """Round a sequence length up to a power of two within [lo, hi]: the tuning key's length bucket."""
    n = max(int(n), lo)
    return min(1 << (n - 1).bit_length(), hi)


# ----------------------------------------------------------------------------- argument checks
def _fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def require_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def require_float(name: str, t: torch.Tensor, dtypes: Collection[torch.dtype] = FLOAT_DTYPES) -> None:
    if t.dtype not in dtypes:
        allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")


def require_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {str(t.dtype).removeprefix('torch.')}")


def require_rank(name: str, t: torch.Tensor, ranks: tuple[int, ...], layout: str) -> None:
    if t.dim() not in ranks:
        raise ValueError(f"{name}: expected shape {layout}, got {_fmt_shape(t)}")


def require_dim(name: str, t: torch.Tensor, dim: int, expected: int, layout: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected shape {layout} with dim {dim} = {expected}, got {_fmt_shape(t)}")


def require_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(t.stride())}")


def require_same_device(pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    first_name, first = pairs[0]
    for name, t in pairs[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} like {first_name}, got {t.device}")


def require_same_dtype(pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    first_name, first = pairs[0]
    for name, t in pairs[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} like {first_name}, got {t.dtype}")


def require_nonempty(name: str, t: torch.Tensor) -> None:
    if t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {_fmt_shape(t)}")


def require_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def resolve_scale(name: str, sm_scale: Any, head_dim: int) -> float:
    """The softmax scale every op validates through: `head_dim ** -0.5` for None, else a finite real
    number as a float (TypeError for other types; ValueError for nan and +-inf, which would turn every
    output into NaN or zero without an error)."""
    if sm_scale is None:
        return float(head_dim) ** -0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"{name}: expected a float or None, got {type(sm_scale).__name__}")
    scale = float(sm_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{name}: expected a finite float, got {scale!r}")
    return scale


INT32_MAX = 2**31 - 1


def require_window(window: Any, causal: bool) -> None:
    if window is None:
        return
    # Kernels take the window as an int32 argument.
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= INT32_MAX:
        raise ValueError(f"window: expected a positive int up to 2**31 - 1 (int32) or None, got {window!r}")
    if not causal:
        raise ValueError("window: a sliding window needs causal=True, got causal=False")


def random_normal(shape: Sequence[int], *, device, dtype, generator: torch.Generator, scale: float = 1.0):
    """Random inputs drawn on the CPU with a seeded generator, then moved (same values on every device).

    On the "meta" device (shapes only, as sweeps compute tuning keys) nothing is drawn."""
    if torch.device(device).type == "meta":
        return torch.empty(tuple(shape), device="meta", dtype=dtype)
    x = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return x.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- reference helpers
def random_indices(limits: torch.Tensor, shape: Sequence[int], *, generator: torch.Generator) -> torch.Tensor:
    """Random int32 indices of `shape` [..., topk], drawn on the CPU.

    Each row [..., :] draws with replacement (so duplicates occur) from [0, limit), where `limits`
    broadcasts to shape[:-1]; slots at or past the row's limit hold -1 (the filler when fewer keys exist
    than slots) and about one slot in 32 is dropped to -1 anywhere.
    """
    limits = limits.to(torch.int64)[..., None]
    # float64 keeps u * limit strictly below the limit for any int32 limit.
    picks = (torch.rand(tuple(shape), generator=generator, dtype=torch.float64) * limits).long()
    slots = torch.arange(shape[-1])
    dropped = torch.rand(tuple(shape), generator=generator) < 1 / 32
    return torch.where((slots < limits) & ~dropped, picks, -1).to(torch.int32)


def masked_softmax(z: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of `z` over its last dim restricted to `valid` (broadcastable to z).

    Returns (p, lse): p is 0 at invalid entries and on rows with no valid entry; lse (last dim
    dropped) is -inf on those rows. No inf - inf or 0/0 is ever formed, so gradients stay finite.
    """
    z = torch.where(valid, z, float("-inf"))
    if z.shape[-1] == 0:  # no entries at all (e.g. NSA before the first complete block)
        return z, z.new_full(z.shape[:-1], float("-inf"))
    # The shift cancels out of both p and lse, so it is a constant for autograd.
    shift = z.amax(-1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    e = torch.exp(z - shift)
    den = e.sum(-1, keepdim=True)
    nonempty = den != 0  # a NaN logit gives a NaN row (and lse), not an empty one
    den = torch.where(nonempty, den, 1.0)
    lse = torch.where(nonempty, torch.log(den) + shift, float("-inf"))
    return e / den, lse.squeeze(-1)
