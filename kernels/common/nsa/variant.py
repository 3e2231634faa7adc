"""NSA as a variant: the autograd Function of an eager call (its forward keeps the parts the backward
kernels read), the entry point `nsa_forward`, the gradients from a forward's parts (`nsa_gradients`,
for both autograd paths), the interpreter's tiles of the forward roles and `NSAGroupCentricBase`, the
variant logic (support, pruning, defaults per head dim and shared memory, launch, the custom op's
backward) each vendor's nsa file subclasses with its spaces. The kernels are in forward.py and
backward.py; the window roles run the attention family's.
"""

from __future__ import annotations

import torch

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.attention.forward import _attention_fwd_kernel
from kreg.kernels.common.attention.tile_rules import packing_reason, tile_blocks
from kreg.kernels.common.nsa.backward import KERNELS as BACKWARD_KERNELS
from kreg.kernels.common.nsa.backward import SWA_ROLES, nsa_backward
from kreg.kernels.common.nsa.forward import (
    NSAForward,
    _nsa_cmp_kernel,
    _nsa_compress_kernel,
    _nsa_slc_kernel,
    _run,
    cmp_tokens,
    nsa_forward_parts,
)
from kreg.kernels.common.tiles import dot_block, next_pow2
from kreg.ops.variant import CallPlan

# ----------------------------------------------------------------------------- autograd and the entry point
GRAD_INPUTS = ("q", "k", "v", "g_cmp", "g_slc", "g_swa")


def nsa_gradients(args: dict, config: CallConfig, parts: NSAForward, dout: torch.Tensor) -> dict:
    """The backward kernels (backward.py) on a forward's parts: gradients by argument name (q, k, v
    and the three gates)."""
    grads = nsa_backward(
        args["q"], args["k"], args["v"], args["g_cmp"], args["g_slc"], args["g_swa"], dout,
        block_size=args["block_size"], window=args["window"], sm_scale=args["sm_scale"],
        block_indices=parts.block_indices, o_cmp=parts.o_cmp, lse_cmp=parts.lse_cmp, o_slc=parts.o_slc,
        lse_slc=parts.lse_slc, o_swa=parts.o_swa, lse_swa=parts.lse_swa, config=config)
    return dict(zip(GRAD_INPUTS, grads, strict=True))


class _NSAFunction(torch.autograd.Function):
    """Autograd for an eager call: the forward keeps its parts (branch outputs, lse, block ids) for the
    backward kernels. The selection is not differentiable; gradients flow to q, k, v and the gates."""

    @staticmethod
    def forward(ctx, q, k, v, g_cmp, g_slc, g_swa, args: dict, config: CallConfig):
        parts = nsa_forward_parts(args, config)
        ctx.save_for_backward(q, k, v, g_cmp, g_slc, g_swa, *parts[1:])
        ctx.rest = {name: args[name] for name in ("block_size", "block_count", "window", "sm_scale")}
        ctx.config = config
        return parts.out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        args = {**dict(zip(GRAD_INPUTS, saved[:6], strict=True)), **ctx.rest}
        parts = NSAForward(None, *saved[6:])
        grads = nsa_gradients(args, ctx.config, parts, dout)
        return (*(grads[name] for name in GRAD_INPUTS), None, None)


def nsa_forward(args: dict, config: CallConfig) -> torch.Tensor:
    """nsa on validated arguments (ops.nsa's dict) with one config per role: out. Without
    gradients o_slc and the lse tensors are never stored; with them the call runs under
    `_NSAFunction`, whose backward launches the bwd_* roles."""
    tensors = [args[name] for name in GRAD_INPUTS]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _NSAFunction.apply(*tensors, args, config)
    return _run(args, config, parts=False).out


# ----------------------------------------------------------------------------- the variant
# The interpreter's tiles per role, its default first. Each extra one is another interpreted run of
# every tiny preset in the conformance test; tests/test_nsa_kernel.py runs other tiles.
INTERPRETER_TILES = {
    "compress": ({"BLOCK_N": 16},),
    "cmp": ({"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}),
    "swa": ({"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 1, "KEY_LOOPS": 3},),  # the attention family's tests try the others
    "slc": ({"BLOCK_N": 16}, {"BLOCK_N": 32}),
}


class NSAGroupCentricBase:
    """The variant's logic; each vendor file subclasses it with `Variant` and sets:

    spaces: a ConfigSpace per role: "compress" (BLOCK_N rows summed per step), "cmp" (BLOCK_M rows =
        tokens x the group's heads, BLOCK_N compressed blocks per tile), "swa" (the attention family's
        forward space of the vendor), "slc" (BLOCK_N keys per step of a selected block);
    WINDOW: the vendor's attention-family data object (its HEAD_DIM_DEFAULTS["fwd"] and
        shared_bytes("fwd", ...) serve the window role);
    HEAD_DIM_DEFAULTS: per role, (largest head dim, fields) rows changing the space's default;
    shared_bytes(role, config, key): shared memory/LDS estimate of the nsa kernels.
    fp32 inputs go to the reference (`supports` is False).
    """

    op = "nsa"
    name = "nsa_group_centric"
    kernels = {"compress": _nsa_compress_kernel, "cmp": _nsa_cmp_kernel, "swa": _attention_fwd_kernel,
               "slc": _nsa_slc_kernel, **BACKWARD_KERNELS}
    HEAD_DIM_DEFAULTS: dict = {}
    WINDOW = None

    def shared_bytes(self, role: str, config: LaunchConfig, key: dict) -> int:
        raise NotImplementedError

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def _shared(self, role: str, config: LaunchConfig, key: dict) -> int:
        if role == "swa":
            return self.WINDOW.shared_bytes("fwd", config, dot_block(key["d"]), 2)
        if role in SWA_ROLES:
            return self.WINDOW.shared_bytes(SWA_ROLES[role], config, dot_block(key["d"]), 2)
        if role.startswith("bwd_"):
            return 0  # no estimate: the sweep's offline compile decides
        return self.shared_bytes(role, config, key)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        blocks = config.blocks
        expected = set(self.spaces[role].blocks)
        if set(blocks) != expected:
            return f"blocks must be {sorted(expected)}, got {sorted(blocks)}"
        if role != "compress" and min(tile_blocks(blocks).values()) < 16:
            return f"tl.dot needs tiles of at least 16, got {blocks}"
        reason = packing_reason(blocks, key)
        if reason is not None:
            return reason
        smallest = {n: min(v) for n, v in self.spaces[role].block_values(device).items()}
        # A tile longer than what it covers only computes masked rows or keys, unless no smaller
        # tile exists to take its place.
        spans = {"slc": {"BLOCK_N": next_pow2(key["block_size"]) * next_pow2(key["block_count"])},
                 "compress": {"BLOCK_N": next_pow2(key["block_size"])},
                 "swa": {"BLOCK_M": key["t"], "BLOCK_N": key["t"]},
                 "cmp": {"BLOCK_N": max(1, key["t"] // key["block_size"])},
                 "bwd_slc_dq": {"BLOCK_N": next_pow2(key["block_size"])},
                 "bwd_slc_dkv": {"BLOCK_N": next_pow2(key["block_size"])}}.get(role, {})
        for block, span in spans.items():
            if blocks[block] > span and blocks[block] > smallest[block]:
                return f"{block}={blocks[block]} is longer than the {span} it covers"
        if role == "cmp" and cmp_tokens(blocks["BLOCK_M"], key["h_q"] // key["h_kv"]) > key["t"] \
                and blocks["BLOCK_M"] > smallest["BLOCK_M"]:
            return f"BLOCK_M={blocks['BLOCK_M']} holds more tokens than the t bucket {key['t']}"
        if device.key == "cpu":
            return None
        need = self._shared(role, config, key)
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory/LDS (> {device.shared_mem_bytes} B)"
        return None

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        space = self.spaces[role]
        base = space.default(device)
        if device.key == "cpu":
            return base
        fields = {**base.blocks, **base.knobs()}
        window_role = {"swa": "fwd", **SWA_ROLES}.get(role)
        if window_role:
            rows = self.WINDOW.HEAD_DIM_DEFAULTS.get(window_role, ())
        else:
            rows = self.HEAD_DIM_DEFAULTS.get(role, ())
        fields.update(next((row for d_max, row in rows if key["d"] <= d_max), {}))
        smallest = {n: min(v) for n, v in space.block_values(device).items()}
        # No tile longer than what it covers (down to the space's smallest); a selected-branch step
        # spans at most one block by default (several are the sweep's to try).
        if role in ("slc", "compress"):
            fields["BLOCK_N"] = max(min(fields["BLOCK_N"], next_pow2(key["block_size"])), smallest["BLOCK_N"])
        if role == "swa":
            for block in ("BLOCK_M", "BLOCK_N"):
                fields[block] = max(min(fields[block], key["t"]), smallest[block])
        blocks = {n: fields.pop(n) for n in space.blocks}
        config = LaunchConfig(blocks=blocks, **fields)
        if space.keep is not None and not space.keep(config, key):
            config = config.model_copy(update={"num_warps": 4})
        # Less shared memory than the defaults assume: fewer stages, then a narrower streamed tile.
        while self.prune_reason(role, config, key, device) is not None:
            if config.num_stages > 1:
                config = config.model_copy(update={"num_stages": config.num_stages - 1})
            elif config.blocks.get("BLOCK_N", 0) > 16:
                blocks = {**config.blocks, "BLOCK_N": config.blocks["BLOCK_N"] // 2}
                config = config.model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks})
            else:
                break
        return config

    def launch(self, args: dict, plan: CallPlan) -> torch.Tensor:
        return nsa_forward(args, plan.config)

    def bind(self, plan: CallPlan):
        config = plan.config
        return lambda args: nsa_forward(args, config)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The backward kernels for the custom op's autograd: its saved output is `out` alone, so the
        forward runs again to keep the parts (one more forward, about a third of the backward)."""
        return nsa_gradients(args, plan.config, nsa_forward_parts(args, plan.config), grad)
