"""Estimated occupancy (`tuning.occupancy`): the register, shared-memory/LDS, warp and program limits of
each target family, worked by hand."""

import pytest

from kreg.core.device import preset
from kreg.tuning.occupancy import occupancy


@pytest.mark.parametrize(("target", "registers", "shared", "warps", "programs", "limit"), [
    # sm_90: 255 registers -> 8192 per warp; 65536 / (4 * 8192) = 2 programs of 4 warps.
    ("h200", 255, 1024, 4, 2, "registers"),
    # 64 registers -> 2048 per warp: 8 programs, 32 of 64 warps.
    ("h200", 64, 0, 4, 8, "registers"),
    # 24 registers, 8 warps: the 64-warp limit (8 programs) comes before the registers (10).
    ("h100", 24, 0, 8, 8, "warps"),
    # 100 KB of shared memory: (232448 + 1024) // (102400 + 1024) = 2 programs.
    ("h200", 32, 102400, 4, 2, "shared"),
    # gfx942: 128 VGPRs -> 4 waves per SIMD, 16 per CU = 4 programs; 32 KB of its 64 KB LDS: 2.
    ("mi300x", 128, 32768, 4, 2, "shared"),
    # gfx950's 160 KB LDS holds 5 such programs: the registers (4) bound it.
    ("mi355x", 128, 32768, 4, 4, "registers"),
    # 60 VGPRs -> 64 allocated, 8 waves per SIMD (the most): 32 waves, 4 programs of 8.
    ("mi355x", 60, 0, 8, 4, "registers"),
])
def test_occupancy_by_hand(target, registers, shared, warps, programs, limit):
    got = occupancy(preset(target), registers, shared, warps)
    assert (got.programs, got.limit) == (programs, limit)
    most = 64 if target.startswith("h") else 32
    assert got.warps == programs * warps and got.fraction == pytest.approx(programs * warps / most)


def test_nonsense_is_refused():
    with pytest.raises(ValueError, match="num_warps"):
        occupancy(preset("h200"), 32, 0, 0)
    with pytest.raises(ValueError, match="not a GPU"):
        occupancy(preset("cpu"), 32, 0, 4)
