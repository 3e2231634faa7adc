"""Pydantic records: what a config space yields, what the database stores and what tables carry.

These objects are validated once, when they are made (from a space, a table file or a database row);
the dispatch hot path only reads plain attributes of an already built record.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TrialStatus = Literal[
    "ok", "compile_error", "out_of_resources", "runtime_error", "wrong_result", "timeout", "pruned"
]
TRIAL_STATUSES: tuple[str, ...] = TrialStatus.__args__  # type: ignore[attr-defined]


def canonical_json(value: object) -> str:
    """One spelling per value: sorted keys, no spaces. Used for database keys and cache keys."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class LaunchConfig(BaseModel):
    """Block sizes and launch knobs of one kernel launch.

    `blocks` holds the kernel's tile constexprs (BLOCK_M, BLOCK_N, BLOCK_H, ...). The knobs default to
    None where a vendor does not have them: `waves_per_eu`, `matrix_instr_nonkdim` and `kpack` are AMD's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: dict[str, int] = Field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None

    @field_validator("blocks")
    @classmethod
    def _blocks_positive(cls, blocks: dict[str, int]) -> dict[str, int]:
        for name, size in blocks.items():
            if size <= 0:
                raise ValueError(f"block size {name} must be positive, got {size}")
        return dict(sorted(blocks.items()))

    @field_validator("num_warps")
    @classmethod
    def _warps_power_of_two(cls, n: int) -> int:
        if n <= 0 or n & (n - 1):
            raise ValueError(f"num_warps must be a positive power of two, got {n}")
        return n

    @field_validator("num_stages")
    @classmethod
    def _stages_positive(cls, n: int) -> int:
        if n < 1:
            raise ValueError(f"num_stages must be >= 1, got {n}")
        return n

    def __hash__(self) -> int:
        # `blocks` is a dict, so the generated frozen-model hash cannot hash it.
        return hash((tuple(self.blocks.items()), tuple(self.knobs().items())))

    def knobs(self) -> dict[str, int]:
        """Keyword arguments for a Triton launch or `triton.compile` options (unset AMD knobs left out)."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        for name in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def to_json(self) -> str:
        return canonical_json(self.model_dump(exclude_none=True))

    @classmethod
    def from_json(cls, text: str) -> LaunchConfig:
        return cls.model_validate_json(text)

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in self.blocks.items()]
        parts += [f"{k}={v}" for k, v in self.knobs().items()]
        return " ".join(parts)


class TrialResult(BaseModel):
    """One config tried on one shape: its status, its time when it ran, and why it did not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    variant: str
    source_hash: str
    device_key: str
    tuning_key: str
    config: LaunchConfig
    status: TrialStatus
    time_ms: float | None = None
    error: str | None = None
    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    triton_version: str
    torch_version: str


class TunedConfig(BaseModel):
    """The winner for (op, device, tuning key): a (variant, config) pair, as tables and databases hold it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    device_key: str
    tuning_key: str
    variant: str
    source_hash: str
    config: LaunchConfig
    time_ms: float | None = Field(default=None, ge=0)
    triton_version: str
    torch_version: str
    updated_at: datetime | None = None

    @field_validator("tuning_key")
    @classmethod
    def _key_is_canonical_json_object(cls, text: str) -> str:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"tuning_key is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("tuning_key must be a JSON object")
        return canonical_json(value)
