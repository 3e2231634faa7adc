"""kreg as a Hugging Face transformers attention backend.

    import kreg.integrations.transformers  # registers "kreg"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kreg")

Importing this module registers `"kreg"` in transformers' `AttentionInterface` (the attention call)
and `AttentionMaskInterface` (the mask each forward builds once; without one of its own a custom
attention function gets no padding mask at all). A call goes to `sink_attention` when the model
passes sinks (gpt-oss's `s_aux`), else to `flash_attention`; a single new token without gradients
goes to `decode`. The model's `scaling`, `sliding_window` and GQA heads go with every call; queries
are aligned bottom-right on the keys, which is what prefill and cached decode steps need.

Masks. The mask hook recognises the masks kreg expresses (causal, sliding-window causal, bidirectional)
and hands the attention a 2-D padding mask, or None when nothing is padded (a static cache's mask over
the tokens seen only cuts the keys there). A padded batch is packed into varlen sequences (as
transformers' FlashAttention path does); the hook works the packing out once per forward (one host
read), and every layer's call reuses it. Anything else (a 4-D mask the caller built, packed-sequence or
image-token overlays, chunked attention), and `dropout > 0`, `softcap` or captured attention weights,
goes to the model's own eager attention, with one logged warning per reason: never a kreg call that
would drop the sinks, the window or the scale. `register(name, vendor=...)` adds the same backend under
another name with one vendor's kernels (on CPU tensors: Triton's interpreter). Under `torch.compile`, a
compiled forward that makes its own mask from a 2-D one (Llama's; GPT-OSS's generate makes it before)
breaks its graph at the hook's host read: use `fullgraph=False` (transformers' default).
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    eager_mask,
)

from kreg import registry

NAME = "kreg"
MIN_VERSION = (5, 17)
log = logging.getLogger(__name__)
_warned: set[str] = set()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


if _version(transformers.__version__) < MIN_VERSION:
    raise ImportError(f"kreg.integrations.transformers needs transformers >= 5.17, found {transformers.__version__}")


# ----------------------------------------------------------------------------- masks
def _and_parts(mask_function: Callable) -> tuple | None:
    """The mask functions `masking_utils.and_masks` combined into this one, or None if it is not one."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    return inspect.getclosurevars(mask_function).nonlocals.get("mask_functions")


def mask_kind(mask_function: Callable) -> str | None:
    """"causal", "sliding" (causal within a window), "bidirectional", or None for a mask kreg cannot
    express. The window itself comes with each attention call (the module's `sliding_window`)."""
    if mask_function is causal_mask_function:
        return "causal"
    if mask_function is bidirectional_mask_function:
        return "bidirectional"
    parts = _and_parts(mask_function)
    if (parts is not None and len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
        return "sliding"
    return None


def kreg_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
              **kwargs):
    """The mask transformers builds once per forward for "kreg": None (no padding: every key the
    cache holds is a token), a boolean padding mask `[b, L]` over the first L keys (as for
    FlashAttention), or, for a mask kreg cannot express, the additive 4-D mask eager attention takes
    (the attention call then runs eager attention with it)."""
    expressible = mask_kind(mask_function) is not None and not kwargs.get("use_vmap", False)
    if expressible and attention_mask is None and not (
            isinstance(q_offset, int) and kv_offset + kv_length == q_offset + q_length):
        # The cache holds more slots than tokens seen (a static cache): a mask over the tokens seen, which
        # the attention cuts the keys to. Its length is one host read per forward (the mask is built once
        # per forward, not per layer). A cache whose first slot is not position 0 goes to eager.
        seen = int(q_offset) + q_length if kv_offset == 0 else None
        if seen is not None and seen <= kv_length:
            return _all_kept(torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device")))
        expressible = False
    if not expressible:
        return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          **kwargs)
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if bool(attention_mask.all()):  # nothing padded; a static cache's empty slots lie past the mask
        return None if attention_mask.shape[1] == kv_length else _all_kept(attention_mask)
    # Every layer of this forward packs the batch alike: work the packing out once here (one host read
    # per forward), not in each layer's call.
    attention_mask.kreg_packing = Packing.of(attention_mask, q_length)
    return attention_mask


def _all_kept(mask: torch.Tensor) -> torch.Tensor:
    """A mask that keeps every one of its positions: the attention only cuts the keys to its length
    (no packing)."""
    mask.kreg_all_kept = True
    return mask


# ----------------------------------------------------------------------------- attention
def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("kreg attention: %s; this call runs the model's eager attention", reason)


def _captures_weights() -> bool:
    """Whether the running forward records attention weights (`output_attentions=True`)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    try:
        return "attentions" in (_active_collector.get() or {})
    except LookupError:
        return False


def _eager(module) -> Callable:
    """The model's own eager attention (gpt-oss's handles its sinks), from the module's file."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise ValueError(f"kreg attention: {type(module).__name__} needs eager attention for this call, and its "
                         "module has no eager_attention_forward")
    return found


def _additive_mask(padding: torch.Tensor | None, query: torch.Tensor, s_k: int, causal: bool,
                   window: int | None) -> torch.Tensor:
    """The 4-D additive mask eager attention would have had, from what "kreg"'s mask hook gave: keys
    past a padding mask `[b, L]` are empty cache slots; queries sit at the last positions of the L."""
    b, _, s_q, _ = query.shape
    length = s_k if padding is None else padding.shape[1]
    pos = torch.arange(length - s_q, length, device=query.device)[:, None]
    key = torch.arange(s_k, device=query.device)[None, :]
    allowed = key < length
    if causal:
        allowed = allowed & (key <= pos)
    if window is not None:
        allowed = allowed & (pos - key < window)
    allowed = allowed[None, None].expand(b, 1, s_q, s_k)
    if padding is not None:
        kept = torch.zeros(b, s_k, dtype=torch.bool, device=query.device)
        kept[:, :length] = padding.bool()
        allowed = allowed & kept[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~allowed, torch.finfo(query.dtype).min)


def _unsupported(attention_mask, dropout, causal, window, kwargs) -> str | None:
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        return "a mask kreg cannot express (a 4-D or custom mask)"
    if dropout:
        return f"dropout {dropout} (kreg has no attention dropout)"
    if kwargs.get("softcap") is not None:
        return "logit softcapping"
    if window is not None and not causal:
        return "a bidirectional sliding window"
    if _captures_weights():
        return "output_attentions (kreg returns no attention weights)"
    return None


class Packing(NamedTuple):
    """A padded batch as varlen sequences, from its padding mask `[b, L]` (queries at its last s_q
    positions): the flat indices of the kept keys and queries, their int32 cu_seqlens and longest
    sequences, and whether each row's kept positions are one run (packing then keeps the distances a
    window needs)."""

    s_q: int
    keys: torch.Tensor
    queries: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    runs_whole: bool

    @classmethod
    def of(cls, mask: torch.Tensor, s_q: int) -> Packing:
        """The packing of `mask` (one host read)."""
        q_mask = mask[:, mask.shape[1] - s_q:]
        k_counts, q_counts = mask.sum(1), q_mask.sum(1)
        runs = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0]
        max_k, max_q, most_runs = torch.stack([k_counts.max(), q_counts.max(), runs.max()]).tolist()
        zero = k_counts.new_zeros(1)
        cu_k = torch.cat([zero, k_counts.cumsum(0)]).to(torch.int32)
        cu_q = torch.cat([zero, q_counts.cumsum(0)]).to(torch.int32)
        return cls(s_q, mask.flatten().nonzero().squeeze(1), q_mask.flatten().nonzero().squeeze(1), cu_q, cu_k,
                   int(max_q), int(max_k), most_runs <= 1)


def _packing(mask: torch.Tensor, s_q: int) -> Packing:
    """The mask hook's packing when it made this mask for these queries, else worked out now."""
    found = getattr(mask, "kreg_packing", None)
    return found if found is not None and found.s_q == s_q else Packing.of(mask.bool(), s_q)


def make_attention(vendor: str | None = None) -> Callable:
    """The transformers attention function, running `vendor`'s kernels (None: this device's best)."""
    flash = registry.get("flash_attention", vendor=vendor)
    sink = registry.get("sink_attention", vendor=vendor)
    decode = registry.get("decode", vendor=vendor)

    def kreg_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                       s_aux=None, **kwargs):
        """`query [b, h_q, s_q, d]`, `key`/`value [b, h_kv, s_k, d]` -> (`out [b, s_q, h_q, d]`, None)."""
        if kwargs.get("block_table") is not None:
            # A paged cache the attention call itself must write the new keys into (continuous batching).
            raise ValueError("block_table: kreg attention does not serve transformers' paged cache; use "
                             "attn_implementation='sdpa' or a flash implementation for continuous batching")
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
        b, _, s_q, _ = query.shape
        reason = _unsupported(attention_mask, dropout, causal, sliding_window, kwargs)
        # A padded batch's packing: the mask hook's (worked out once per forward), looked up once here.
        packing = None
        if reason is None and attention_mask is not None and not getattr(attention_mask, "kreg_all_kept", False):
            packing = _packing(attention_mask, s_q)
            if sliding_window is not None and not packing.runs_whole:
                reason = "a padding mask with holes under a sliding window"
        if reason is not None:
            _warn_once(reason)
            if attention_mask is None or attention_mask.dim() == 2:
                attention_mask = _additive_mask(attention_mask, query, key.shape[2], causal, sliding_window)
            return _eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  sliding_window=sliding_window, s_aux=s_aux, **kwargs)
        sinks = None if s_aux is None else _fp32_sinks(s_aux)
        common = dict(sm_scale=scaling, window=sliding_window)
        q = query.transpose(1, 2)  # [b, s_q, h_q, d]: views, the last dimension stays contiguous
        if attention_mask is not None:
            length = attention_mask.shape[1]  # a static cache holds empty slots past the mask
            key, value = key[:, :, :length], value[:, :, :length]
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        if packing is not None:
            return _padded(flash, sink, q, k, v, packing, causal, sinks, common), None
        packed = _fa_packed(kwargs, b)
        if packed is not None:
            out = _call(flash, sink, q[0], k[0], v[0], causal, sinks, **common, **packed)
            return out.unsqueeze(0), None
        if s_q == 1 and causal and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
            out = decode(q[:, 0], k, v, _whole_cache(b, q.device), sinks=sinks, **common)
            return out.unsqueeze(1), None
        return _call(flash, sink, q, k, v, causal, sinks, **common), None

    return kreg_attention


# id(sinks parameter) -> (a weak reference to it, its state: version counter, address, dtype; its fp32 copy).
_SINKS: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _fp32_sinks(s_aux: torch.Tensor) -> torch.Tensor:
    """A layer's sinks as the fp32 contiguous tensor kreg takes. Without gradients the copy of a sinks
    parameter is kept until the parameter changes (an in-place update moves its version counter; new
    data assigned to `.data`, as `module.to` does, changes its address or dtype), so a decode step casts
    none (a cast kernel per layer per token otherwise); with gradients, under torch.compile, or for a
    tensor without a version counter, it is cast on every call."""
    if s_aux.dtype == torch.float32 and s_aux.is_contiguous():
        return s_aux
    if (torch.is_grad_enabled() and s_aux.requires_grad) or torch.compiler.is_compiling() or s_aux.is_inference():
        return s_aux.to(torch.float32).contiguous()
    key, state = id(s_aux), (s_aux._version, s_aux.data_ptr(), s_aux.dtype, s_aux.device)
    found = _SINKS.get(key)
    if found is not None and found[0]() is s_aux and found[1] == state:
        return found[2]
    made = s_aux.detach().to(torch.float32).contiguous()
    _SINKS[key] = (weakref.ref(s_aux, lambda _, key=key: _SINKS.pop(key, None)), state, made)
    return made


# (device, batch) -> int32 lengths of the int32 maximum: decode clamps each length to the cache's
# capacity, so this one tensor says "every key the cache holds" for any step.
_WHOLE_CACHE: dict[tuple[torch.device, int], torch.Tensor] = {}


def _whole_cache(batch: int, device: torch.device) -> torch.Tensor:
    """decode's `cache_seqlens` for a step over every key of the cache: one tensor kept per device and
    batch, so a step allocates and fills none (a fill kernel per layer per token otherwise); made
    afresh while torch.compile traces, which must not capture a tensor made outside it."""
    if torch.compiler.is_compiling():
        return torch.full((batch,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device)
    found = _WHOLE_CACHE.get((device, batch))
    if found is None:
        found = _WHOLE_CACHE.setdefault(
            (device, batch), torch.full((batch,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device))
    return found


def _call(flash, sink, q, k, v, causal, sinks, **kwargs) -> torch.Tensor:
    if sinks is not None:
        return sink(q, k, v, sinks=sinks, causal=causal, **kwargs)
    return flash(q, k, v, causal=causal, **kwargs)


def _fa_packed(kwargs: dict, batch: int) -> dict | None:
    """FlashAttention's packed-sequence keywords (a flattening data collator's), as kreg varlen arguments."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if any(kwargs.get(name) is None for name in names):
        return None
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q: packed sequences come as a batch of 1, got a batch of {batch}")
    cu_q, cu_k, max_q, max_k = (kwargs[name] for name in names)
    return dict(cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                max_seqlen_q=int(max_q), max_seqlen_k=int(max_k))


def _padded(flash, sink, q, k, v, p: Packing, causal, sinks, common) -> torch.Tensor:
    """A padded batch as varlen sequences of its kept tokens; padded query rows come back as zeros."""
    b, s_q, h_q, d = q.shape
    out = q.new_zeros((b * s_q, h_q, d))
    if p.max_q == 0:
        return out.view(b, s_q, h_q, d)
    packed = _call(flash, sink, q.reshape(b * s_q, h_q, d).index_select(0, p.queries),
                   k.reshape(-1, *k.shape[2:]).index_select(0, p.keys),
                   v.reshape(-1, *v.shape[2:]).index_select(0, p.keys),
                   causal, sinks, cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, max_seqlen_q=p.max_q,
                   max_seqlen_k=max(p.max_k, 1), **common)
    return out.index_copy(0, p.queries, packed).view(b, s_q, h_q, d)


def register(name: str = NAME, *, vendor: str | None = None) -> str:
    """Register kreg's attention and mask under `name` (`attn_implementation=name`), with `vendor`'s
    kernels when given; returns the name."""
    AttentionInterface.register(name, make_attention(vendor))
    AttentionMaskInterface.register(name, kreg_mask)
    return name


register()
