"""Pydantic records: what a config space yields, what the database stores and what tables carry.

A call launches one or more kernels, each in a role ("fwd", "bwd_dq", "split", ...): a `LaunchConfig`
is one kernel's launch, a `CallConfig` the launches of a whole call by role.

These objects are validated once, when they are made (from a space, a table file or a database row);
the dispatch hot path only reads plain attributes of an already built record.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator

from kreg.core.device import INTERPRETER_VENDOR

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


ROLE_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


def is_backward_role(role: str) -> bool:
    """Roles named `bwd...` run in a call's backward (timed on the backward's own time); every other
    role runs in its forward."""
    return role.startswith("bwd")


class CallConfig(RootModel[dict[str, LaunchConfig]]):
    """The launch configs of every kernel one call launches, by role: `{"fwd": ..., "bwd_dq": ...}`
    (a decode call: `{"split": ..., "combine": ...}`). What a variant's space yields, what a trial
    records and what a tuned entry stores. Its JSON sorts the roles; variants launch by role name."""

    model_config = ConfigDict(frozen=True)

    @field_validator("root")
    @classmethod
    def _roles_named(cls, roles: dict[str, LaunchConfig]) -> dict[str, LaunchConfig]:
        if not roles:
            raise ValueError("a call config needs at least one role")
        for role in roles:
            if not ROLE_PATTERN.fullmatch(role) or role in LaunchConfig.model_fields:
                raise ValueError(f"role names are lower-case identifiers other than a LaunchConfig field, "
                                 f"got {role!r}")
        return roles

    @model_validator(mode="before")
    @classmethod
    def _one_config_is_the_forward(cls, value: object) -> object:
        # Tables and databases written before roles existed hold one LaunchConfig: the forward's.
        if isinstance(value, LaunchConfig):
            return {"fwd": value}
        if isinstance(value, dict) and value and set(value) <= set(LaunchConfig.model_fields):
            return {"fwd": value}
        return value

    def __getitem__(self, role: str) -> LaunchConfig:
        return self.root[role]

    def __contains__(self, role: object) -> bool:
        return role in self.root

    def __hash__(self) -> int:
        # Equal call configs (dict equality ignores role order) hash alike.
        return hash(frozenset(self.root.items()))

    def roles(self) -> tuple[str, ...]:
        return tuple(self.root)

    def items(self):
        return self.root.items()

    def replace(self, role: str, config: LaunchConfig) -> CallConfig:
        """This call config with `role` set to `config` (added last when it was missing)."""
        return CallConfig({**self.root, role: config})

    def to_data(self) -> dict[str, dict]:
        """Plain data by role, unset AMD knobs left out (what JSON files and columns hold)."""
        return {role: c.model_dump(exclude_none=True) for role, c in self.root.items()}

    def to_json(self) -> str:
        return canonical_json(self.to_data())

    @classmethod
    def from_json(cls, text: str) -> CallConfig:
        return cls.model_validate_json(text)

    def __str__(self) -> str:
        if list(self.root) == ["fwd"]:
            return str(self.root["fwd"])
        return " ".join(f"{role}[{config}]" for role, config in self.root.items())


class TrialResult(BaseModel):
    """One call config tried on one shape: its status, its time when it ran, and why it did not.

    `role` is the role this trial varied (None for trials recorded before roles existed); the time is
    that role's phase: the forward call, or the backward alone for `bwd...` roles."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    variant: str
    vendor: str | None = None
    source_hash: str
    device_key: str
    tuning_key: str
    config: CallConfig
    role: str | None = None
    status: TrialStatus
    time_ms: float | None = None
    error: str | None = None
    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    triton_version: str
    torch_version: str


class TunedConfig(BaseModel):
    """The winner for (op, device, tuning key): a variant of a vendor and its call config, as tables and
    databases hold it. `time_ms` is the forward call's time, `backward_ms` the backward's (when the
    sweep timed one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    device_key: str
    tuning_key: str
    variant: str
    vendor: str | None = None
    source_hash: str
    config: CallConfig
    time_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    backward_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
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

    @property
    def variant_vendor(self) -> str:
        """The vendor whose variant this entry names: the recorded one, or (entries from before vendors
        were recorded) its device key's ("<vendor>-<model>"), the interpreter's vendor for "cpu",
        whose sweeps ran that vendor's variants."""
        if self.vendor is not None:
            return self.vendor
        return INTERPRETER_VENDOR if self.device_key == "cpu" else self.device_key.split("-", 1)[0]
