"""Which stored entries answer a lookup: device matching (most specific card first) and, for a key never
tuned, the nearest tuned key. Shared by the database (`store`) and the shipped tables (`table_files`);
it knows no op's dim names (ops say which dims are lengths)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping

from kreg.core.device import DeviceIdentity
from kreg.core.records import TunedConfig, canonical_json


def match_level(want: DeviceIdentity, have: DeviceIdentity) -> int | None:
    """How closely a stored device matches the asked one: 0 same key, PCI id and SM count; 1 same key;
    2 same vendor and arch (another card of that arch); None no match."""
    if have.key == want.key:
        same_card = have.pci_device_id == want.pci_device_id and have.num_sms == want.num_sms
        return 0 if same_card else 1
    if have.vendor == want.vendor and have.arch == want.arch:
        return 2
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def key_distance(want: Mapping[str, object], have: Mapping[str, object], length_dims: Collection[str]) -> float | None:
    """Sum of |log2(a/b)| over the length dims (the op's `length_dims`); None when any other dim differs."""
    if want.keys() != have.keys():
        return None
    total = 0.0
    for name, a in want.items():
        b = have[name]
        if name in length_dims and _is_number(a) and _is_number(b):
            # Lengths are bucketed to >= 16; clamping at 1 only guards log2 against 0.
            total += abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))  # type: ignore[arg-type]
        elif a != b or isinstance(a, bool) != isinstance(b, bool):
            return None
    return total


# Whether a lookup may answer with an entry (dispatch passes over entries that do not fit their variant).
Accept = Callable[[TunedConfig], bool]


def _first_accepted(ranked: list[tuple[tuple, TunedConfig]], accept: Accept | None) -> TunedConfig | None:
    # Stable: among equal ranks the candidates keep their order, as `min` would pick them.
    ranked.sort(key=lambda item: item[0])
    return next((tuned for _, tuned in ranked if accept is None or accept(tuned)), None)


def _recency(tuned: TunedConfig) -> float:
    return tuned.updated_at.timestamp() if tuned.updated_at is not None else 0.0


def pick_best(
    want: DeviceIdentity, candidates: Iterable[tuple[DeviceIdentity, TunedConfig]], accept: Accept | None = None
) -> TunedConfig | None:
    """The candidate of the most specific device match; among equals, the most recently updated. Only
    candidates `accept` takes count (it is asked in rank order, and only until one is taken)."""
    ranked = []
    for have, tuned in candidates:
        level = match_level(want, have)
        if level is not None:
            ranked.append(((level, -_recency(tuned)), tuned))
    return _first_accepted(ranked, accept)


def pick_nearest(
    want: DeviceIdentity, dims: Mapping[str, object], candidates: Iterable[tuple[DeviceIdentity, TunedConfig]],
    length_dims: Collection[str], accept: Accept | None = None,
) -> TunedConfig | None:
    """At the most specific device level that has a comparable key, the key nearest to `dims` in
    its length dims (see `key_distance`); `accept` as in `pick_best`."""
    scored = []
    for have, tuned in candidates:
        level = match_level(want, have)
        if level is None:
            continue
        distance = key_distance(dims, json.loads(tuned.tuning_key), length_dims)
        if distance is not None:
            scored.append(((level, distance, -_recency(tuned), tuned.tuning_key), tuned))
    return _first_accepted(scored, accept)


def canonical_key(tuning_key: str | Mapping[str, object], name: str = "tuning_key") -> str:
    if isinstance(tuning_key, Mapping):
        return canonical_json(dict(tuning_key))
    if not isinstance(tuning_key, str):
        raise TypeError(f"{name}: expected a JSON object string or a dict, got {type(tuning_key).__name__}")
    try:
        value = json.loads(tuning_key)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: expected a JSON object, got {tuning_key!r} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {tuning_key!r}")
    return canonical_json(value)


def check_device(device: object, name: str = "device") -> None:
    for attr in ("key", "vendor", "arch", "name", "num_sms"):
        if not hasattr(device, attr):
            raise TypeError(f"{name}: expected a DeviceInfo (key, vendor, arch, name, pci_device_id, "
                            f"num_sms), got {type(device).__name__}")
