"""Every variant's default configs (at its op's full preset keys) and every shipped tuned config
compile for their targets with no spills and within shared memory/LDS: sm_90 for NVIDIA variants,
gfx942 and gfx950 for AMD ones. Compiles run in a subprocess without TRITON_INTERPRET."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.base import load_all

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"nvidia": "h200", "amd": "mi300x,mi355x"}
VARIANTS = sorted({(v.name, v.vendor) for vs in load_all().values() for v in vs})


@pytest.mark.parametrize("what", ["defaults", "tables"])
@pytest.mark.parametrize("name,vendor", VARIANTS, ids=[f"{n}-{v}" for n, v in VARIANTS])
def test_configs_compile_without_spills(name, vendor, what):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--variant", name, "--vendor", vendor, "--target", TARGETS[vendor], "--json"]
    if what == "tables":
        argv.append("--tables")
    proc = subprocess.run([sys.executable, "-m", "tuning.compile_check", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    unfit = [(r["arch"], r["key"], r["config"], r["kernel"], r["reason"]) for r in rows if not r["fits"]]
    assert proc.returncode == 0 and not unfit, unfit or proc.stderr[-2000:]
    assert all(r["spills"] == 0 for r in rows)
    if what == "defaults":
        assert rows, proc.stderr[-2000:]
