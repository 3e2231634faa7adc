"""Config spaces as a sweep sees them: each variant's space, deduplicated, with static pruning."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.base import Variant
from registry.device import DeviceInfo
from tuning_db.records import LaunchConfig


@dataclass(frozen=True)
class Candidate:
    variant: Variant
    config: LaunchConfig
    pruned: str | None  # why static pruning rejected it, or None


def interpreter_equivalent(config: LaunchConfig) -> LaunchConfig:
    """The interpreter ignores launch knobs: configs that differ only in them are one config there."""
    return LaunchConfig(blocks=config.blocks)


def candidates(variants: list[Variant], key: dict, device: DeviceInfo) -> list[Candidate]:
    """Every (variant, config) a sweep tries for `key`, in space order, with static pruning applied."""
    out: list[Candidate] = []
    for variant in variants:
        if not variant.supports(key, device):
            continue
        seen: set[LaunchConfig] = set()
        for config in variant.space(key, device):
            if device.key == "cpu":
                config = interpreter_equivalent(config)
            if config in seen:
                continue
            seen.add(config)
            out.append(Candidate(variant, config, variant.prune_reason(config, key, device)))
    return out
