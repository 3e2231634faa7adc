"""FlashMLA's own CUDA sparse-prefill kernel (SM90) beside kreg's sparse_mla forward, in one process.

    python -m kreg.benchmarks.flashmla_peer --collect FLASHMLA_CHECKOUT [--cutlass CUTLASS_CHECKOUT]
    python -m kreg.benchmarks.flashmla_peer [--sources .peers/flashmla] [--build build/flashmla_peer]

`--collect` (once, on a machine with a FlashMLA clone: `git clone https://github.com/deepseek-ai/FlashMLA`
and `git -C FlashMLA submodule update --init csrc/cutlass`, or any CUTLASS clone holding the commit
FlashMLA pins, given as --cutlass) exports the SM90 sparse-prefill sources and the CUTLASS headers at
that commit into the git-ignored .peers/flashmla and packs them as .peers/flashmla.tar.xz (about 1 MB)
to carry to a GPU machine without network; unpack it there into .peers/. Nothing of it is committed.

The first run compiles FlashMLA's two SM90 phase-1 instantiations (d_qk 576 and 512, no sink, no
topk_length) and kreg's binding (benchmarks/flashmla_peer.cpp) with nvcc for sm_90a and the flags
FlashMLA's setup.py passes, links them against this PyTorch and loads the library
(`torch.ops.kreg_flashmla_peer.sparse_prefill`); later runs reuse the build. Ninja is not needed:
the three objects compile in parallel processes. Then, at every shape of benchmarks/sparse_mla.py,
both are checked against the op's reference on the reduced shape (as every benchmark row is) and
against each other on the full one, and both are timed on the same tensors (CUDA-graph quantiles).
Hopper (sm_90) only; the sources are FlashMLA's and NVIDIA's and stay out of the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from kreg import registry
from kreg.benchmarks.common import checked, measure
from kreg.benchmarks.sparse_mla import OP, SHAPES, _name
from kreg.ops.testing import output_error

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BINDING = HERE / "flashmla_peer.cpp"
INSTANTIATIONS = ("csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu")
INCLUDES = ("csrc", "csrc/kerutils/include", "csrc/sm90", "csrc/cutlass/include", "csrc/cutlass/tools/util/include")
# FlashMLA's setup.py flags for its nvcc compiles (less its ptxas report and line info), for sm_90a only.
NVCC_FLAGS = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]
LIBRARY = "libkreg_flashmla_peer.so"


# FlashMLA's files the SM90 sparse prefill builds from, and CUTLASS's header trees.
FLASHMLA_FILES = ("csrc/params.h", "csrc/utils.h", "csrc/defines.h", "csrc/sm90/helpers.h", "csrc/sm90/prefill/sparse",
                  "csrc/kerutils/include")
CUTLASS_TREES = ("include", "tools/util/include")


def _export(repo: Path, commit: str, paths: tuple, dest: Path, prefix: str = "") -> None:
    """`git archive` of `paths` at `commit` of `repo` (a work tree or a bare clone), unpacked into `dest`."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", f"--prefix={prefix}", commit, *paths],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def collect(flashmla: Path, cutlass: Path | None, root: Path) -> Path:
    """Fill root/flashmla with the sources `build` needs (FlashMLA at its checkout's HEAD, CUTLASS at the
    commit FlashMLA pins) and pack them as root/flashmla.tar.xz; the archive's path."""
    dest = root / "flashmla"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    commit = _git(flashmla, "rev-parse", "HEAD").strip()
    pinned = _git(flashmla, "ls-tree", commit, "csrc/cutlass").split()[2]  # the submodule's commit
    _export(flashmla, commit, FLASHMLA_FILES, dest)
    _export(cutlass or flashmla / "csrc" / "cutlass", pinned, CUTLASS_TREES, dest, prefix="csrc/cutlass/")
    (dest / "SOURCES").write_text(f"FlashMLA {commit}\nCUTLASS {pinned}\n")
    packed = root / "flashmla.tar.xz"
    with tarfile.open(packed, "w:xz") as tar:
        tar.add(dest, arcname="flashmla")
    return packed


def _torch_paths() -> tuple[list[str], list[str], str]:
    """(include dirs, library dirs, CUDA home) of this PyTorch's C++ extension toolchain."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None:
        raise SystemExit("flashmla_peer: no CUDA toolkit found (nvcc); this benchmark needs a GPU machine")
    return cpp_extension.include_paths("cuda"), cpp_extension.library_paths("cuda"), home


def build(sources: Path, out: Path) -> Path:
    """Compile and link the peer library into `out` (unless it is newer than every input); its path."""
    missing = [p for p in (*INSTANTIATIONS, "csrc/params.h", "csrc/cutlass/include/cute/tensor.hpp")
               if not (sources / p).exists()]
    if missing:
        raise SystemExit(f"flashmla_peer: {sources} lacks {', '.join(missing)}; fill it with "
                         "`python -m kreg.benchmarks.flashmla_peer --collect FLASHMLA_CHECKOUT` (or unpack "
                         ".peers/flashmla.tar.xz into .peers/)")
    out.mkdir(parents=True, exist_ok=True)
    library = out / LIBRARY
    inputs = [BINDING, *(sources / p for p in INSTANTIATIONS), sources / "SOURCES"]
    if library.exists() and all(library.stat().st_mtime > p.stat().st_mtime for p in inputs if p.exists()):
        return library
    torch_includes, torch_libs, cuda_home = _torch_paths()
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    includes = [f"-I{sources / d}" for d in INCLUDES]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    jobs = []
    for cu in INSTANTIATIONS:
        obj = out / (Path(cu).stem + ".o")
        jobs.append((obj, [nvcc, *NVCC_FLAGS, abi, *includes, "-c", str(sources / cu), "-o", str(obj)]))
    binding = out / "binding.o"
    cxx = os.environ.get("CXX", "c++")
    jobs.append((binding, [cxx, "-O2", "-std=c++20", "-fPIC", abi, *includes, *(f"-I{d}" for d in torch_includes),
                           f"-I{os.path.join(cuda_home, 'include')}", "-c", str(BINDING), "-o", str(binding)]))
    running = [(obj, cmd, subprocess.Popen(cmd)) for obj, cmd in jobs]
    failed = [" ".join(cmd) for _, cmd, proc in running if proc.wait() != 0]
    if failed:
        raise SystemExit("flashmla_peer: compile failed:\n" + "\n".join(failed))
    link = [cxx, "-shared", "-o", str(library), *(str(obj) for obj, _ in jobs), *(f"-L{d}" for d in torch_libs),
            f"-L{os.path.join(cuda_home, 'lib64')}", f"-L{os.path.join(cuda_home, 'lib64', 'stubs')}",
            "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-lcudart", "-lcuda"]
    subprocess.run(link, check=True)
    return library


def load(sources: Path, out: Path):
    """The peer's call, `(q, kv, indices, sm_scale, d_v) -> (out, max_logits, lse)`, built if needed."""
    torch.ops.load_library(str(build(sources, out)))
    return torch.ops.kreg_flashmla_peer.sparse_prefill


def run(peer, dtype: torch.dtype = torch.bfloat16) -> list:
    """Both forwards at every sparse_mla benchmark shape: [(shape, kreg Measurement, FlashMLA
    Measurement, relative error between them)]."""
    handle = registry.get("sparse_mla")
    ours = lambda a: handle(**a)  # noqa: E731
    theirs = lambda a: tuple(peer(a["q"], a["kv"], a["indices"], float(a["sm_scale"]), a["d_v"]))  # noqa: E731
    rows = []
    for shape in SHAPES:
        small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        our_err, their_err = checked(OP, small, ours), checked(OP, small, theirs)
        args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        between = output_error(OP, tuple(ours(args)), theirs(args), args)
        flops, name = OP.flops(args), _name(shape)
        ours_ms = measure("sparse_mla fwd", name, "kreg", lambda a=args: ours(a), flops, "TFLOP/s", our_err)
        theirs_ms = measure("sparse_mla fwd", name, "flashmla", lambda a=args: theirs(a), flops, "TFLOP/s", their_err)
        rows.append((name, ours_ms, theirs_ms, between))
        del args
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kreg.benchmarks.flashmla_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=Path, default=ROOT / ".peers" / "flashmla",
                        help="FlashMLA's sources as --collect lays them out")
    parser.add_argument("--build", type=Path, default=ROOT / "build" / "flashmla_peer", help="build folder")
    parser.add_argument("--collect", type=Path, metavar="FLASHMLA_CHECKOUT",
                        help="export the sources from a FlashMLA clone into .peers/ and pack them, then exit")
    parser.add_argument("--cutlass", type=Path, help="with --collect: a CUTLASS clone holding FlashMLA's pinned commit")
    opts = parser.parse_args(argv)
    if opts.collect is not None:
        print(collect(opts.collect, opts.cutlass, opts.sources.parent))
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("flashmla_peer: needs an sm_90 GPU (H100/H200)", file=sys.stderr)
        return 2
    peer = load(opts.sources, opts.build)
    print(f"{torch.cuda.get_device_name()}; FlashMLA sources: "
          f"{(opts.sources / 'SOURCES').read_text().split()[1] if (opts.sources / 'SOURCES').exists() else '?'}")
    print("| shape | kreg ms | kreg TFLOP/s | FlashMLA ms | FlashMLA TFLOP/s | kreg / FlashMLA speed | "
          "rel err kreg, FlashMLA (reduced) | kreg vs FlashMLA (full) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, ours, theirs, between in run(peer):
        print(f"| {name} | {ours.median_ms:.3f} | {ours.rate():.0f} | {theirs.median_ms:.3f} | {theirs.rate():.0f} | "
              f"{theirs.median_ms / ours.median_ms:.3f}x | {ours.rel_err:.1e}, {theirs.rel_err:.1e} | {between:.1e} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
