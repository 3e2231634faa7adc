"""Estimated occupancy of a compiled kernel: how many of its warps (NVIDIA) or waves (AMD) one SM or
CU holds at once, from its registers, shared memory/LDS and warps per program against the target's
limits. It ranks configs that compile cleanly (`--compile-only`'s resource reports, the AMD defaults);
it ignores what else limits residency (barriers, scratch, the grid being too small).

NVIDIA sm_90: 64 warps and 32 programs per SM, registers allocated per warp in units of 256, shared
memory per SM the per-program maximum plus the 1 KB the runtime reserves per program.
AMD CDNA3/4 (gfx942, gfx950): 4 SIMDs per CU, 8 waves per SIMD, 512 registers per SIMD lane
(VGPRs and AGPRs together) allocated in units of 8, LDS per CU the target's (64 KB, 160 KB).
"""

from __future__ import annotations

from dataclasses import dataclass

from kreg.core.device import DeviceInfo

NVIDIA_MAX_WARPS, NVIDIA_MAX_PROGRAMS, NVIDIA_REGISTER_UNIT, NVIDIA_SHARED_RESERVED = 64, 32, 256, 1024
AMD_SIMDS, AMD_WAVES_PER_SIMD, AMD_REGISTERS_PER_LANE, AMD_REGISTER_UNIT = 4, 8, 512, 8


@dataclass(frozen=True)
class Occupancy:
    programs: int  # programs resident on one SM/CU
    warps: int  # their warps (waves on AMD)
    fraction: float  # of the most warps/waves an SM/CU holds
    limit: str  # what bounds it: "registers", "shared", "warps" or "programs"


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(device: DeviceInfo, registers: int, shared_bytes: int, num_warps: int) -> Occupancy:
    """The estimate for one kernel of `num_warps` warps per program (`registers` per thread or lane)."""
    if num_warps < 1 or registers < 0 or shared_bytes < 0:
        raise ValueError(f"expected num_warps >= 1 and non-negative resources, got {num_warps}, {registers}, "
                         f"{shared_bytes}")
    if device.vendor == "nvidia":
        per_warp = max(_round_up(registers * device.warp_size, NVIDIA_REGISTER_UNIT), NVIDIA_REGISTER_UNIT)
        bounds = {"registers": device.registers_per_sm // (per_warp * num_warps),
                  "warps": NVIDIA_MAX_WARPS // num_warps, "programs": NVIDIA_MAX_PROGRAMS}
        if shared_bytes:
            shared_per_sm = device.shared_mem_bytes + NVIDIA_SHARED_RESERVED
            bounds["shared"] = shared_per_sm // (shared_bytes + NVIDIA_SHARED_RESERVED)
        most = NVIDIA_MAX_WARPS
    elif device.vendor == "amd":
        per_simd = min(AMD_WAVES_PER_SIMD, AMD_REGISTERS_PER_LANE // max(_round_up(registers, AMD_REGISTER_UNIT),
                                                                         AMD_REGISTER_UNIT))
        bounds = {"registers": AMD_SIMDS * per_simd // num_warps, "warps": AMD_SIMDS * AMD_WAVES_PER_SIMD // num_warps}
        if shared_bytes:
            bounds["shared"] = device.shared_mem_bytes // shared_bytes
        most = AMD_SIMDS * AMD_WAVES_PER_SIMD
    else:
        raise ValueError(f"device {device.key!r} is not a GPU target")
    limit = min(bounds, key=lambda name: bounds[name])
    programs = bounds[limit]
    return Occupancy(programs, programs * num_warps, programs * num_warps / most, limit)
