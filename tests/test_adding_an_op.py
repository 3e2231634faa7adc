"""Adding an op touches only the op's own files (docs/adding-an-op.md): in a copy of the repository, a toy
op written as a contract, a shared kernel and one variant file per vendor is listed, dispatched to both
vendors' kernels (in the interpreter) and to its reference, is a custom op, passes the conformance
test, compiles offline for gfx942, and keeps the layer rules."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

CONTRACT = '''
"""toy_scale: out = x * scale, a toy op for tests/test_adding_an_op.py."""

import torch

from kreg.core.records import canonical_json  # noqa: F401 (any layer below ops may be used)
from kreg.ops.contract import DTYPE_NAMES, Op, TensorSpec, bucket_pow2, random_normal, require_float, require_tensor


def validate(x: torch.Tensor, scale: float = 2.0) -> dict:
    """toy_scale(x, scale=2.0) -> x * scale; x [n, d] fp16/bf16/fp32."""
    require_tensor("x", x)
    require_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [n, d], got {list(x.shape)}")
    return {"x": x, "scale": float(scale)}


def reference(x, scale):
    return (x.float() * scale).to(x.dtype)


def tuning_key(args):
    x = args["x"]
    return (("d", x.shape[1]), ("dtype", DTYPE_NAMES[x.dtype]), ("n", bucket_pow2(x.shape[0])))


def make_inputs(shape, *, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return {"x": random_normal((shape["n"], shape["d"]), device=device, dtype=dtype, generator=gen)}


OP = Op(
    name="toy_scale", summary="x * scale", validate=validate, reference=reference, tuning_key=tuning_key,
    flops=lambda a: float(a["x"].numel()), bytes_moved=lambda a: 2.0 * a["x"].numel() * a["x"].element_size(),
    make_inputs=make_inputs, presets={"tiny": [{"n": 37, "d": 20}], "full": [{"n": 4096, "d": 256}]},
    length_dims=("n",), output_specs=lambda a: TensorSpec(tuple(a["x"].shape), a["x"].dtype),
)
'''

KERNEL = '''
"""toy_scale's kernel, both vendors."""

import torch
import triton
import triton.language as tl

from kreg.kernels.common.tiles import cdiv


@triton.jit
def _toy_scale_kernel(X, OUT, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(OUT + offs, (x.to(tl.float32) * scale).to(OUT.dtype.element_ty), mask=offs < n)


class ToyScaleBase:
    op = "toy_scale"
    name = "toy_scale_flat"
    kernels = {"fwd": _toy_scale_kernel}

    def launch(self, args, plan):
        x = args["x"].contiguous()
        out = torch.empty_like(x)
        block = plan.config["fwd"].blocks["BLOCK"]
        _toy_scale_kernel[(cdiv(x.numel(), block),)](x, out, x.numel(), args["scale"], BLOCK=block,
                                                      **plan.config["fwd"].knobs())
        return out
'''

VENDOR = '''
"""toy_scale on {vendor}."""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.toy_scale import ToyScaleBase
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class ToyScale{title}(ToyScaleBase, Variant):
    vendor = "{vendor}"
    spaces = {{"fwd": ConfigSpace(blocks={{"BLOCK": (256, 1024)}}, knobs={{"num_warps": (4,)}},
                                  defaults={{"*": {{"BLOCK": 1024, "num_warps": 4}}}},
                                  interpreter=({{"BLOCK": 16}}, {{"BLOCK": 64}}))}}
'''

CHECK = '''
import torch
from kreg import registry

assert "toy_scale" in registry.ops(), registry.ops()
x = torch.randn(37, 20, dtype=torch.float16)
for vendor in ("nvidia", "amd"):
    handle = registry.get("toy_scale", vendor=vendor)
    assert torch.equal(handle(x, 3.0), (x.float() * 3.0).half()), vendor
    assert handle.choice(x).variant.name == "toy_scale_flat"
assert torch.equal(registry.get("toy_scale")(x, 3.0), (x.float() * 3.0).half())  # the reference on CPU
assert hasattr(torch.ops.kreg, "toy_scale")
print("OK")
'''


def _copy_repository(target: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _run(argv: list[str], cwd: Path, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(cwd), os.environ.get("PYTHONPATH"))))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.long
def test_a_toy_op_is_only_its_own_files(tmp_path):
    repo = tmp_path / "repo"
    _copy_repository(repo)
    (repo / "ops" / "toy_scale.py").write_text(textwrap.dedent(CONTRACT))
    (repo / "kernels" / "common" / "toy_scale.py").write_text(textwrap.dedent(KERNEL))
    for vendor in ("nvidia", "amd"):
        text = textwrap.dedent(VENDOR).format(vendor=vendor, title=vendor.capitalize())
        (repo / "kernels" / vendor / "toy_scale.py").write_text(text)

    check = _run([sys.executable, "-c", CHECK], repo, interpret=True)
    assert check.returncode == 0 and "OK" in check.stdout, check.stderr[-3000:]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    conformance = _run([*pytest, "tests/test_conformance.py", "-k", "toy_scale"], repo, interpret=True)
    # Both vendors' variants in the interpreter on a CPU; the GPU's own vendor on a GPU.
    ran = int(re.search(r"(\d+) passed", conformance.stdout).group(1)) if " passed" in conformance.stdout else 0
    assert conformance.returncode == 0 and ran == (1 if torch.cuda.is_available() else 2), conformance.stdout[-3000:]
    layers = _run([*pytest, "tests/test_layers.py"], repo, interpret=True)
    assert layers.returncode == 0, layers.stdout[-3000:]
    compiled = _run([sys.executable, "-m", "kreg.tuning.compile_check", "--variant", "toy_scale_flat",
                     "--vendor", "amd", "--target", "mi300x", "--json"], repo, interpret=False)
    assert compiled.returncode == 0 and '"kernel": "_toy_scale_kernel"' in compiled.stdout, compiled.stderr[-3000:]
