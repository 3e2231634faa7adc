"""Which device a tensor lives on, what it is called in the tuning database, and what it can hold.

A device key (`nvidia-h200`, `amd-mi355x`, `cpu`) names a tuning table. Targets that are not present
(for compile-only sweeps, or to name a table) come from the named presets below.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import torch

# The GPU vendors kreg has kernels for, each with its variants in kernels/<vendor>/. The interpreter
# (CPU tensors under TRITON_INTERPRET=1, sweeps on the "cpu" device) runs the first one's by default.
VENDORS = ("nvidia", "amd")
INTERPRETER_VENDOR = VENDORS[0]


@dataclass(frozen=True)
class DeviceInfo:
    """A device's identity (each part its own database column) and the limits kernels are sized by."""

    key: str                 # tuning-table name: "<vendor>-<model>" or "cpu"
    vendor: str              # "nvidia", "amd" or "cpu"
    arch: str                # "sm_90", "gfx942", "gfx950", "cpu"
    name: str                # marketing name as the driver reports it
    pci_device_id: int | None
    num_sms: int             # SMs (NVIDIA) or CUs (AMD)
    shared_mem_bytes: int    # per program: shared memory (NVIDIA, opt-in maximum) or LDS (AMD)
    registers_per_sm: int
    warp_size: int

    @property
    def target(self) -> tuple[str, int | str, int]:
        """(backend, arch, warp size) as `triton.backends.compiler.GPUTarget` takes them."""
        if self.vendor == "nvidia":
            return ("cuda", int(self.arch.removeprefix("sm_")), self.warp_size)
        if self.vendor == "amd":
            return ("hip", self.arch, self.warp_size)
        raise ValueError(f"device {self.key!r} is not a GPU target")


class DeviceIdentity(Protocol):
    """What a lookup knows of a device: `DeviceInfo`, a stored device and a table's device descriptor
    all have these attributes."""

    key: str
    vendor: str
    arch: str
    name: str
    pci_device_id: int | None
    num_sms: int


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, which `taskset` or a container's cpuset
    narrows, not the machine's count (a sweep sharing a GPU machine's cores with another job)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform (macOS, Windows)
        return os.cpu_count() or 1


CPU = DeviceInfo("cpu", "cpu", "cpu", "cpu", None, usable_cores(), 0, 0, 1)

# Named targets. Shared memory is the per-block opt-in maximum (NVIDIA) or the LDS per workgroup (AMD).
PRESETS: dict[str, DeviceInfo] = {
    "h100": DeviceInfo("nvidia-h100", "nvidia", "sm_90", "NVIDIA H100 80GB HBM3", 0x2330, 132, 232448, 65536, 32),
    "h200": DeviceInfo("nvidia-h200", "nvidia", "sm_90", "NVIDIA H200", 0x2335, 132, 232448, 65536, 32),
    "mi300x": DeviceInfo("amd-mi300x", "amd", "gfx942", "AMD Instinct MI300X", 0x74A1, 304, 65536, 131072, 64),
    "mi355x": DeviceInfo("amd-mi355x", "amd", "gfx950", "AMD Instinct MI355X", 0x75A3, 256, 163840, 131072, 64),
    "cpu": CPU,
}
ALIASES = {"mi355": "mi355x", "mi300": "mi300x"}


def preset(name: str) -> DeviceInfo:
    """A named target: h100, h200, mi300x (mi300), mi355x (mi355) or cpu."""
    canonical = ALIASES.get(name.lower(), name.lower())
    if canonical not in PRESETS:
        known = ", ".join(sorted(PRESETS) + sorted(ALIASES))
        raise ValueError(f"unknown device {name!r}; expected one of {known}")
    return PRESETS[canonical]


def _model_from_name(vendor: str, name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'AMD Instinct MI355X' -> 'mi355x'; unknown names are slugged."""
    lowered = name.lower()
    for model in ("h200", "h100", "h800", "h20", "gh200", "b200", "a100"):
        if model in lowered.split() or f" {model}" in f" {lowered}":
            return model
    for model in ("mi355x", "mi350x", "mi325x", "mi300x", "mi300a", "mi250x"):
        if model in lowered:
            return model
    slug = "".join(c if c.isalnum() else "-" for c in lowered).strip("-")
    return slug.removeprefix(f"{vendor}-") or "unknown"


def _pci_product_id(props) -> int | None:
    """The PCI product id (0x2335 for an H200 SXM) from sysfs; torch's `pci_device_id` is the slot on
    the bus, not the model. None where sysfs does not show the device."""
    address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
               f"{getattr(props, 'pci_device_id', 0):02x}.0")
    try:
        with open(f"/sys/bus/pci/devices/{address}/device") as f:
            return int(f.read().strip(), 16)
    except (OSError, ValueError):
        return None


@functools.cache
def _detect_gpu(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0))
    regs = int(getattr(props, "regs_per_multiprocessor", 65536))
    pci = _pci_product_id(props)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]
        model = _model_from_name("amd", props.name)
        if model == "unknown" or not model.startswith("mi"):
            model = {"gfx942": "mi300x", "gfx950": "mi355x"}.get(arch, arch)
        return DeviceInfo(f"amd-{model}", "amd", arch, props.name, pci, props.multi_processor_count,
                          smem or 65536, regs, 64)
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(f"nvidia-{_model_from_name('nvidia', props.name)}", "nvidia", f"sm_{major}{minor}",
                      props.name, pci, props.multi_processor_count, smem, regs, 32)


def detect(device: torch.device | str | int | None = None) -> DeviceInfo:
    """DeviceInfo of a torch device (the current CUDA/ROCm device when None and one exists, else CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return CPU
    if device.type != "cuda":
        raise ValueError(f"device: expected a CPU or CUDA/ROCm device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _detect_gpu(index)


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
