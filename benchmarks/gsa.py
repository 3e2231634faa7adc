"""GSA (Gated Sparse Attention) on a GPU: the layer, the fused top-k and the sparse attention, each
against its peer in the same process; and `python -m benchmarks.gsa`, the standalone tool.

`run()` (what `python -m benchmarks.run` prints) measures the rows of the performance targets:
- the layer's forward at B 1, T 4096 (D 2048, 16 heads of 128, 4 index heads of 64, k 2048): the
  registry backend against the same module through the PyTorch references, time and peak memory;
- gsa_topk at T 8192 and 32768, k 2048: the fused kernel against the indexer kernel + torch.topk (with
  the peak memory of both: the fused one never holds the [b, T, T] scores);
- gsa_sparse_attention at T 4096 and 8192 (16 heads of 128, k 2048): gathered K/V bytes per second,
  read against the copy ceiling of the same run (L2 reuse across queries is what can beat it); the
  forward as dispatched and through each variant serving the key (head block, dense masked tiles,
  each row naming its kernels' times), on the preset's indices (drawn with replacement: many repeated
  keys) and on distinct top-k indices as gsa_topk gives them; the head block with each row's indices
  sorted (the sort timed in: the op does not care about slot order, so sorting is a legal way to
  gather in address order); and the backward (its rate counts twice the forward's bytes: the dq pass
  gathers K and V rows, the dkv pass Q and dO rows).
FLOPs of the layer: its projections (2 * T * D * out features each), the indexer's causal scoring
(2 * h_i * pairs * d_i) and the sparse attention (4 * T * H * k' * d, k' = min(k, i + 1) summed).

The standalone tool (flags: `python -m benchmarks.gsa --help`) verifies the registry backend against the
reference on a short sequence, then prints throughput (tokens/s) and peak memory of both backends across
T (a backend that runs out of memory says so, and the sweep goes on), writes them as long-format CSV
and, when matplotlib is installed, a plot of time and peak memory against T; `--only topk` (or layer,
attention) prints one target's rows of `run()` instead, such as the top-k pair alone. `--profile` and `--ncu` run
warm-up passes outside a `torch.cuda.profiler.start()/stop()` capture for Nsight Systems
(`--capture-range=cudaProfilerApi`) and Nsight Compute (`--profile-from-start off`); the README's GSA
section has the commands. NVTX ranges name every step of the layer (`gsa/<step>`), every kernel launch
and each backend's passes (`gsa_reference/forward`, `gsa_registry/forward`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kreg import registry
from kreg.benchmarks.common import PROVIDER, Measurement, checked, checked_backward, long_rows, measure, write_csv
from kreg.core.nvtx import nvtx_range
from kreg.ops import OPS
from kreg.ops.testing import backward_call, relative_error

FAMILY = "gsa"
LAYER = {"d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "head_dim": 128, "d_indexer": 64,
         "n_indexer_heads": 4, "k": 2048}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("reference", "registry")
INDEXER_ARGS = ("q_idx", "k_idx", "w", "bias", "sm_scale")
_NOTES: list[str] = []


# ----------------------------------------------------------------------------- the layer
def layer_flops(b: int, t: int, cfg: dict = LAYER) -> float:
    """The layer forward's FLOPs (module docstring)."""
    d_model, h, h_kv, d = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    h_i, d_i, k = cfg["n_indexer_heads"], cfg["d_indexer"], cfg["k"]
    out_features = 3 * h * d + 3 * h_kv * d + h_i * d_i + d_i + h_i  # q, o, output gate; k, v, value gate
    projections = 2 * b * t * d_model * out_features
    pairs = t * (t + 1) // 2
    selected = sum(min(k, i + 1) for i in range(t))
    return projections + 2 * b * h_i * pairs * d_i + 4 * b * h * selected * d


def make_models(dtype: torch.dtype, seed: int = 0, cfg: dict = LAYER):
    """(reference, registry) layers on the GPU with one set of weights: the registry layer loads the
    reference's state_dict (strict), as a user swapping backends would."""
    from kreg.layers import GatedSparseAttention

    torch.manual_seed(seed)
    ref = GatedSparseAttention(**cfg, backend="reference")
    with torch.no_grad():
        ref.indexer.idx_bias.normal_(0.0, 0.5)
    ref = ref.to(device="cuda", dtype=dtype).eval()
    opt = GatedSparseAttention(**cfg, backend="registry").to(device="cuda", dtype=dtype).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    return ref, opt


def _input(b: int, t: int, dtype: torch.dtype, seed: int = 1, cfg: dict = LAYER) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, cfg["d_model"], generator=gen).to(device="cuda", dtype=dtype)


def _forward(model, x):
    def call():
        with torch.no_grad():
            return model(x)
    return call


def peak_bytes(fn) -> int:
    """Peak memory one call of `fn` allocates above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def verify(ref, opt, b: int, t: int, dtype: torch.dtype, atol: float) -> tuple[bool, float, float]:
    """(passed, relative error, max abs difference) of the registry layer's output against the
    reference's at one shape; passed is torch.allclose(atol=atol, rtol=atol), the GSA tool's criterion."""
    x = _input(b, t, dtype, seed=2)
    want, got = _forward(ref, x)(), _forward(opt, x)()
    ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=atol)
    return ok, relative_error(got, want), (got.float() - want.float()).abs().max().item()


def _measure_backend(model, b: int, t: int, dtype: torch.dtype) -> tuple[tuple[float, float, float], int] | str:
    """((p20, p50, p80) ms, peak bytes) of the forward, or "OOM"."""
    from kreg.tuning.bench import time_gpu_quantiles

    try:
        call = _forward(model, _input(b, t, dtype))
        peak = peak_bytes(call)
        return time_gpu_quantiles(call), peak
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    finally:
        torch.cuda.empty_cache()


def layer_sweep(ref, opt, b: int, lengths: list[int], dtype: torch.dtype, ref_max_t: int) -> list[dict]:
    """One row per T: each backend's times and peak memory, "OOM" or "skipped"."""
    rows = []
    for t in lengths:
        row = {"T": t}
        for name, model in zip(BACKENDS, (ref, opt), strict=True):
            if name == "reference" and t > ref_max_t:
                row[name] = "skipped"
            else:
                row[name] = _measure_backend(model, b, t, dtype)
            print(f"  T {t:6d} {name:9s}: {_cell(row[name], b, t)}", flush=True)
        rows.append(row)
    return rows


def _cell(result, b: int, t: int) -> str:
    if isinstance(result, str):
        return result
    (_, ms, _), peak = result
    return f"{ms:9.3f} ms {b * t / ms * 1e3:12.0f} tok/s {peak / 2**20:9.0f} MiB"


def print_table(rows: list[dict], b: int) -> None:
    print(f"{'T':>6} | {'reference ms':>12} {'tok/s':>10} {'peak MiB':>9} | {'registry ms':>11} {'tok/s':>10} "
          f"{'peak MiB':>9} | {'speedup':>7} {'memory':>7}")
    for row in rows:
        cells = []
        for name in BACKENDS:
            result = row[name]
            if isinstance(result, str):
                cells.append(f"{result:>12} {'':>10} {'':>9}")
            else:
                (_, ms, _), peak = result
                cells.append(f"{ms:12.3f} {b * row['T'] / ms * 1e3:10.0f} {peak / 2**20:9.0f}")
        ref, opt = row["reference"], row["registry"]
        both = not isinstance(ref, str) and not isinstance(opt, str)
        speed = f"{ref[0][1] / opt[0][1]:6.1f}x" if both else f"{'-':>7}"
        memory = f"{opt[1] / max(ref[1], 1):6.2f}x" if both else f"{'-':>7}"
        print(f"{row['T']:>6} | {cells[0]} | {cells[1]} | {speed} {memory}")


def sweep_csv_rows(rows: list[dict], b: int, device: str) -> list[dict]:
    """Long-format rows (benchmarks.common.CSV_FIELDS) of the sweep: time and throughput per backend and
    T, plus a peak_memory row (MiB)."""
    out = []
    for row in rows:
        for name in BACKENDS:
            result = row[name]
            if isinstance(result, str):
                continue
            ms, peak = result
            provider = PROVIDER if name == "registry" else "torch-reference"
            m = Measurement("gsa layer fwd", f"B {b} T {row['T']}", provider, ms, layer_flops(b, row["T"]),
                            "TFLOP/s", None)
            timed = long_rows([m], device)
            mib = peak / 2**20
            out += timed + [{**timed[0], "metric": "peak_memory", "unit": "MiB", "p20": mib, "p50": mib, "p80": mib}]
    return out


def plot(rows: list[dict], b: int, path: Path, title: str) -> bool:
    """Time and peak memory against T for both backends, saved to `path`; False (and a message) when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get one)")
        return False
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name in BACKENDS:
        points = [(row["T"], row[name]) for row in rows if not isinstance(row[name], str)]
        if points:
            time_ax.plot([t for t, _ in points], [r[0][1] for _, r in points], marker="o", label=name)
            mem_ax.plot([t for t, _ in points], [r[1] / 2**20 for _, r in points], marker="o", label=name)
    for ax, label in ((time_ax, "forward time (ms)"), (mem_ax, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"T (B = {b})")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- profiling captures
def capture(ref, opt, b: int, t: int, dtype: torch.dtype, passes: int, which: tuple[str, ...],
            warmup: int = 2) -> None:
    """Warm-up passes (compiles, autotuned lookups, allocator) outside the capture, then
    torch.cuda.profiler.start(), `passes` forward passes of each backend in `which` (each inside an
    NVTX range gsa_<backend>/forward), torch.cuda.profiler.stop()."""
    x = _input(b, t, dtype)
    models = [(name, model) for name, model in zip(BACKENDS, (ref, opt), strict=True) if name in which]
    for _, model in models:
        for _ in range(warmup):
            _forward(model, x)()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, model in models:
        for _ in range(passes):
            with nvtx_range(f"gsa_{name}/forward"):
                _forward(model, x)()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# ----------------------------------------------------------------------------- benchmarks.run rows
def _layer_measurements(dtype: torch.dtype, t: int = 4096) -> list[Measurement]:
    ref, opt = make_models(dtype)
    _, err, _ = verify(ref, opt, 1, 512, dtype, atol=0.1)
    shape = f"B 1 T {t} D {LAYER['d_model']} H {LAYER['n_heads']} k {LAYER['k']}"
    out = []
    for name, model, provider in (("registry", opt, PROVIDER), ("reference", ref, "torch-reference")):
        result = _measure_backend(model, 1, t, dtype)
        if isinstance(result, str):
            _NOTES.append(f"gsa layer fwd {shape}: the {name} backend ran out of memory")
            continue
        ms, peak = result
        out.append(Measurement("gsa layer fwd", shape, provider, ms, layer_flops(1, t), "TFLOP/s",
                               err if name == "registry" else None))
        _NOTES.append(f"gsa layer fwd {shape}: {name} peak memory {peak / 2**20:.0f} MiB")
    del ref, opt
    torch.cuda.empty_cache()
    return out


def _topk_measurements(dtype: torch.dtype) -> list[Measurement]:
    op, indexer = OPS["gsa_topk"], registry.get("gsa_indexer")
    handle = registry.get("gsa_topk")
    out = []
    for shape in op.presets["full"]:
        if shape["t"] not in (8192, 32768):
            continue
        small = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        err = checked(op, small, lambda a: handle(**a))
        args = op.validate(**op.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        name = f"T {shape['t']} k {shape['k']} h_i {shape['h_i']} d_i {shape['d_i']}"
        fused = lambda a=args: handle(**a)  # noqa: E731
        unfused = lambda a=args: torch.topk(indexer(*(a[n] for n in INDEXER_ARGS)), a["k"], dim=-1).indices  # noqa: E731
        for provider, call in ((PROVIDER, fused), ("indexer+torch.topk", unfused)):
            try:
                peak = peak_bytes(call)
                out.append(measure("gsa_topk fwd", name, provider, call, op.flops(args), "TFLOP/s",
                                   err if provider == PROVIDER else None))
                _NOTES.append(f"gsa_topk {name}: {provider} peak memory {peak / 2**20:.0f} MiB")
            except torch.cuda.OutOfMemoryError:
                _NOTES.append(f"gsa_topk {name}: {provider} ran out of memory")
            torch.cuda.empty_cache()
    return out


def causal_topk_indices(b: int, t: int, k: int, device, seed: int = 0) -> torch.Tensor:
    """Indices as gsa_topk gives them: each query's k best keys by random causal scores, distinct, -1
    past its i + 1 causal keys ([b, t, k] int32). The preset's indices (`make_inputs`) draw with
    replacement instead, so about a fifth to a third of their slots repeat a key."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((b, t, t), generator=gen, device=device)
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), -1.0)
    best = scores.topk(min(k, t), dim=-1)
    indices = torch.where(best.values >= 0, best.indices, -1).to(torch.int32)
    return torch.nn.functional.pad(indices, (0, k - indices.shape[-1]), value=-1)


def _attention_measurements(dtype: torch.dtype) -> list[Measurement]:
    """Per T: the forward as dispatched (PROVIDER) and through each variant that serves the key, on the
    preset's indices (with repeats) and on distinct top-k indices (what the layer passes); the head
    block on indices sorted per row; the backward as dispatched. A variant's row names the time of each
    of its kernels; which variant dispatch chose, and each variant's peak memory, go to the notes."""
    from kreg.benchmarks.common import kernel_ms
    from kreg.core.device import detect

    op = OPS["gsa_sparse_attention"]
    device = detect()
    handle = registry.get("gsa_sparse_attention")
    headblock = registry.get(op.name, variant="gsa_sparse_attention_headblock")
    call = lambda a: handle(**a)  # noqa: E731
    out = []
    for shape in op.presets["full"]:
        if shape["t"] not in (4096, 8192):
            continue
        t, k = shape["t"], shape["k"]
        small = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        args = op.validate(**op.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        small_t = small["q"].shape[1]
        indices = {"": (small, args),
                   ", top-k indices": ({**small, "indices": causal_topk_indices(1, small_t, k, "cuda", seed=1)},
                                       {**args, "indices": causal_topk_indices(1, t, k, "cuda")})}
        name = f"T {t} H {shape['h_q']} d {shape['d']} k {k}"
        key = dict(op.tuning_key(args))
        # Lowest priority (the head block) first: benchmarks.run compares our row with the first peer.
        serving = sorted((v for v in registry.variants(op.name, device.vendor) if v.supports(key, device)),
                         key=lambda v: v.priority)
        choice = handle.choice(**args)
        _NOTES.append(f"gsa_sparse_attention {name}: dispatch runs "
                      f"{choice.variant.name if choice.variant else 'the reference'} ({choice.source})")
        for suffix, (small_args, full_args) in indices.items():
            what = f"gsa_sparse_attention fwd{suffix}"
            work = op.bytes_moved(full_args)
            out.append(measure(what, name, PROVIDER, lambda a=full_args: call(a), work, "TB/s",
                               checked(op, small_args, call)))
            for variant in serving:
                named = registry.get(op.name, variant=variant.name)
                fn = lambda a=full_args, h=named: h(**a)  # noqa: E731
                err = checked(op, small_args, lambda a, h=named: h(**a))
                peak = peak_bytes(fn)
                kernels = [kernel for role, kernel in variant.kernels.items() if not role.startswith("bwd")]
                out.append(measure(what, name, f"kreg {variant.name} ({kernel_ms(fn, kernels)})", fn, work, "TB/s",
                                   err))
                _NOTES.append(f"{what} {name}: {variant.name} peak memory {peak / 2**20:.0f} MiB")
        by_address = lambda a=args: headblock(**{**a, "indices": a["indices"].sort(-1).values})  # noqa: E731
        out.append(measure("gsa_sparse_attention fwd", name, "kreg head block, indices sorted per row (sort timed)",
                           by_address, op.bytes_moved(args), "TB/s", None))
        bwd_err = checked_backward(op, small, call)
        out.append(measure("gsa_sparse_attention bwd", name, PROVIDER, backward_call(op, call, args),
                           2 * op.bytes_moved(args), "TB/s", bwd_err))
        torch.cuda.empty_cache()
    return out


TARGET_ROWS = {"layer": _layer_measurements, "topk": _topk_measurements, "attention": _attention_measurements}


def run(dtype: torch.dtype = torch.bfloat16, only: tuple[str, ...] = tuple(TARGET_ROWS)) -> list[Measurement]:
    """The targets' rows (module docstring), those of `only` (TARGET_ROWS' names); peak memories and
    OOMs go to `notes()`."""
    _NOTES.clear()
    return [m for name in only for m in TARGET_ROWS[name](dtype)]


def notes() -> list[str]:
    return list(_NOTES)


# ----------------------------------------------------------------------------- the tool
def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not lengths or any(t <= 0 for t in lengths):
        raise argparse.ArgumentTypeError(f"expected positive lengths, got {text!r}")
    return lengths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gsa", description="GSA layer: registry backend "
                                "vs the PyTorch reference (verify, throughput and memory table, plot, profiling)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="fp32 runs the references only")
    p.add_argument("--skip-verify", action="store_true", help="skip the correctness check")
    p.add_argument("--verify-T", type=int, default=256, help="sequence length of the correctness check")
    p.add_argument("--atol", type=float, default=0.1, help="tolerance of the check (atol and rtol)")
    p.add_argument("--B", type=int, default=1, help="batch size of the table")
    p.add_argument("--T", type=_lengths, default=_lengths("1024,2048,4096,8192,16384,32768,65536"),
                   help="comma-separated sequence lengths of the table")
    p.add_argument("--ref-max-T", type=int, default=16384, help="longest T the reference is timed at")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where the CSV and the plot go")
    p.add_argument("--targets", action="store_true", help="also the performance targets' rows (run())")
    p.add_argument("--only", choices=tuple(TARGET_ROWS), default=None,
                   help="only these target rows (topk: the fused top-k against the indexer + torch.topk at "
                        "T 8192 and 32768), without the layer table")
    p.add_argument("--profile", action="store_true", help="nsys mode: capture --profile-iters passes")
    p.add_argument("--profile-T", type=int, default=2048)
    p.add_argument("--profile-B", type=int, default=1)
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--profile-ref-only", action="store_true")
    p.add_argument("--profile-opt-only", action="store_true")
    p.add_argument("--ncu", action="store_true", help="ncu mode: capture exactly one forward pass per backend")
    p.add_argument("--ncu-T", type=int, default=2048)
    p.add_argument("--ncu-B", type=int, default=1)
    p.add_argument("--ncu-ref-only", action="store_true")
    p.add_argument("--ncu-opt-only", action="store_true")
    args = p.parse_args(argv)
    if args.profile and args.ncu:
        p.error("--profile and --ncu: choose one capture")
    if args.only and (args.profile or args.ncu):
        p.error("--only: target rows are timed, not captured; drop --profile/--ncu")
    for prefix in ("profile", "ncu"):
        if getattr(args, f"{prefix}_ref_only") and getattr(args, f"{prefix}_opt_only"):
            p.error(f"--{prefix}-ref-only and --{prefix}-opt-only: choose at most one")
    return args


def _which(ref_only: bool, opt_only: bool) -> tuple[str, ...]:
    return ("reference",) if ref_only else ("registry",) if opt_only else BACKENDS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    from kreg.core.device import detect

    device = detect()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32:
        print("fp32: the GSA kernels take bf16/fp16, so both backends run the references")
    if args.only:
        print(f"{device.name}, {args.dtype}: the {args.only} target rows")
        _print_targets(run(dtype, (args.only,)))
        return 0
    ref, opt = make_models(dtype)
    if args.profile or args.ncu:
        mode = "profile" if args.profile else "ncu"
        b, t = getattr(args, f"{mode}_B"), getattr(args, f"{mode}_T")
        which = _which(getattr(args, f"{mode}_ref_only"), getattr(args, f"{mode}_opt_only"))
        passes = args.profile_iters if args.profile else 1
        capture(ref, opt, b, t, dtype, passes, which)
        print(f"captured {passes} forward pass(es) of {', '.join(which)} at B {b} T {t} ({mode})")
        return 0
    if not args.skip_verify:
        ok, err, worst = verify(ref, opt, 1, args.verify_T, dtype, args.atol)
        print(f"verify at T {args.verify_T}: {'PASS' if ok else 'FAIL'} (relative error {err:.2e}, "
              f"max |diff| {worst:.3e}, atol = rtol = {args.atol})")
        if not ok:
            return 1
    print(f"{device.name}, {args.dtype}, B {args.B}: forward of the GSA layer")
    rows = layer_sweep(ref, opt, args.B, args.T, dtype, args.ref_max_T)
    print_table(rows, args.B)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = args.out_dir / f"gsa-layer-{device.key}.csv"
    write_csv(sweep_csv_rows(rows, args.B, device.name), str(csv_path))
    print(f"long-format rows: {csv_path}")
    png = args.out_dir / f"gsa-layer-{device.key}.png"
    if plot(rows, args.B, png, f"GSA layer forward, {device.name}, {args.dtype}, B {args.B}"):
        print(f"plot: {png}")
    if args.targets:
        del ref, opt
        torch.cuda.empty_cache()
        _print_targets(run(dtype))
    return 0


def _print_targets(measurements: list[Measurement]) -> None:
    for m in measurements:
        rate = f"{m.rate():8.2f} {m.unit}"
        err = "-" if m.rel_err is None else f"{m.rel_err:.1e}"
        print(f"{m.op:26s} {m.shape:34s} {m.provider:44s} {m.median_ms:10.3f} ms {rate}  err {err}")
    for line in notes():
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
