"""The README's Python examples run as written: each ```python block in its own process, on the CPU
(every op's PyTorch reference), from an empty folder, without the Triton interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_there_is_an_example_for_every_op():
    from kreg import registry

    calls = "\n".join(BLOCKS)
    missing = [op for op in registry.ops() if f'registry.get("{op}")' not in calls]
    assert not missing, f"README.md has no ```python example calling {missing}"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_example_runs_on_a_cpu(code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", KREG_TUNING_DB=f"sqlite:///{tmp_path / 'tuning.db'}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README example failed:\n{code}\n{done.stdout}\n{done.stderr}"
