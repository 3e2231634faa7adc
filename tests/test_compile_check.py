"""Offline compile checks (no GPU): what a call launches is recorded from its launcher on meta tensors,
typed as the JIT types it for the target, compiled for sm_90, gfx942 and gfx950, and its resources read.

Compiles run in a subprocess without TRITON_INTERPRET, which conftest sets on machines without a GPU
(an interpreted kernel can be neither recorded nor compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kreg.core import device as device_info
from kreg.core.records import CallConfig, LaunchConfig
from kreg.ops.catalog import load_all
from kreg.tuning.compile_check import main

from .conftest import run_compile_check

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"b": 2, "s_q": 8192, "s_k": 8192, "h_q": 32, "h_kv": 8, "d": 128, "causal": True, "window": None}


def _env() -> dict[str, str]:
    # The repo first, then whatever path supplies the dependencies (a GPU machine's carried wheels).
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": path}


def _compile_check(*argv: str) -> tuple[int, list[dict]]:
    proc, rows = run_compile_check(*argv, timeout=300)
    assert rows, proc.stderr[-3000:]
    return proc.returncode, rows


def _script(tmp_path: Path, source: str, *argv: str) -> list[dict]:
    """Run `source` in a process without the interpreter; its JSON lines."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return rows


def _variant(vendor: str, name: str = "flash_attention_tiled"):
    return next(v for vs in load_all().values() for v in vs if v.vendor == vendor and v.name == name)


def _fwd(**fields) -> CallConfig:
    return CallConfig({"fwd": LaunchConfig(**fields)})


def test_nvidia_default_fits_h200_and_oversized_does_not():
    """The forward of every call the key serves (padded and varlen; without lse and, as a backward runs
    it, with it) compiles for each config."""
    h200 = device_info.preset("h200")
    key = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 8, "h_q": 32, "s_k": 8192, "s_q": 8192, "window": None}
    default = _variant("nvidia").default_config(key, h200)
    huge = default.replace("fwd", LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128, "HEADS": 1, "KEY_LOOPS": 3},
                                               num_warps=8, num_stages=5))
    rc, rows = _compile_check("--variant", "flash_attention_tiled", "--vendor", "nvidia", "--target", "h200",
                              "--shape-json", json.dumps(SHAPE), "--config-json", default.to_json(),
                              "--config-json", huge.to_json(), "--roles", "fwd")
    assert rc == 1  # something did not fit
    assert {r["kernel"] for r in rows} == {"_attention_fwd_kernel"} and {r["key"]["h_q"] for r in rows} == {32}
    fitting = [r for r in rows if r["config"] == json.loads(default.to_json())]
    big = [r for r in rows if r["config"] == json.loads(huge.to_json())]
    assert len(fitting) == len(big) == 4  # padded and varlen, each with and without lse
    for fit in fitting:
        assert fit["arch"] == "sm_90" and fit["fits"] and fit["spills"] == 0 and fit["reason"] is None
        assert 0 < fit["registers"] <= 255 and 0 < fit["shared_bytes"] <= h200.shared_mem_bytes
    for row in big:
        assert not row["fits"] and row["shared_bytes"] > h200.shared_mem_bytes and "shared memory" in row["reason"]


@pytest.mark.long
def test_amd_default_fits_gfx942_and_gfx950_and_lds_overflow_is_caught():
    key = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 8, "h_q": 32, "s_k": 8192, "s_q": 8192, "window": None}
    variant = _variant("amd")
    defaults = {variant.default_config(key, device_info.preset(t)).to_json() for t in ("mi300x", "mi355x")}
    assert len(defaults) == 1  # one default for both here, so one call checks it on both targets
    default = CallConfig.from_json(defaults.pop())
    # LDS overflow compiles fine on AMD: only the check against the target's budget catches it.
    wide = default.replace("fwd", LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128, "HEADS": 1, "KEY_LOOPS": 3},
                                               num_warps=8, num_stages=2, kpack=1))
    rc, rows = _compile_check("--variant", "flash_attention_tiled", "--vendor", "amd", "--target", "mi300x,mi355x",
                              "--shape-json", json.dumps(SHAPE), "--config-json", default.to_json(),
                              "--config-json", wide.to_json(), "--roles", "fwd")
    assert rc == 1
    by_arch: dict[tuple, list] = {}
    for row in rows:
        by_arch.setdefault((row["arch"], row["config"]["fwd"]["blocks"]["BLOCK_N"]), []).append(row)
    small = default["fwd"].blocks["BLOCK_N"]
    for arch in ("gfx942", "gfx950"):
        assert len(by_arch[arch, small]) == 4  # padded and varlen, with and without lse
        for row in by_arch[arch, small]:
            assert row["fits"] and row["spills"] == 0 and row["detail"]["vgpr_spill_count"] == 0, row
            assert 0 < row["registers"] <= 512 and 0 < row["shared_bytes"] <= 65536
    assert by_arch["gfx942", 128]
    for overflow in by_arch["gfx942", 128]:
        assert not overflow["fits"] and overflow["shared_bytes"] > 65536 and "shared memory" in overflow["reason"]


def test_recorded_launches_are_typed_as_the_jit_types_them(tmp_path):
    """decode's split kernel takes s_q, the GQA group and h_kv as run-time integers: one token makes s_q
    a constant (a value of 1), h_kv 16 is marked divisible by 16 and a group of 4 is not; pointers are
    aligned, and AMD adds its 32-bit pointer ranges. Nothing in these facts is written down by hand:
    they come from Triton's own binder on the recorded launch."""
    rows = _script(tmp_path, """
        import json, sys
        import torch
        from kreg.core.device import preset
        from kreg.ops.catalog import load_all
        from kreg.tuning.launch_record import meta_calls, record_calls, specialize

        shape = {"b": 4, "s_q": 1, "h_q": 64, "h_kv": 16, "d": 64, "n": 8192, "block_size": None, "sinks": True,
                 "window": None, "ragged": False}
        for name in ("h200", "mi300x"):
            device = preset(name)
            variant = next(v for v in load_all()["decode"] if v.vendor == device.vendor)
            calls = meta_calls("decode", shape, torch.bfloat16)
            config = variant.default_config({"h_kv": 16, "h_q": 64, "d": 64, "s_q": 1}, device)
            launch = next(l for l in record_calls(variant, calls[:1], config, device)
                          if l.kernel.fn.__name__ == "_decode_split_kernel")
            job = specialize(launch, device)
            names = launch.kernel.arg_names
            attrs = {names[path[0]]: [a[0] for a in value] for path, value in job.attrs}
            constexprs = {names[path[0]]: value for path, value in job.constexprs}
            print(json.dumps({"target": name, "signature": dict(job.signature), "attrs": attrs,
                              "s_q": constexprs.get("s_q"), "roles": sorted(launch.roles)}))
    """)
    by_target = {row["target"]: row for row in rows}
    assert set(by_target) == {"h200", "mi300x"}
    for row in by_target.values():
        assert row["signature"]["s_q"] == "constexpr" and row["s_q"] == 1
        assert row["signature"]["group"] == "i32" and row["signature"]["Q"] == "*bf16"
        assert "tt.divisibility" in row["attrs"]["h_kv"] and "tt.divisibility" not in row["attrs"].get("group", [])
        assert "tt.divisibility" in row["attrs"]["Q"] and row["roles"] == ["split"]
    assert "tt.pointer_range" in by_target["mi300x"]["attrs"]["Q"]
    assert "tt.pointer_range" not in by_target["h200"]["attrs"]["Q"]


def test_every_role_of_every_variant_is_launched_at_a_full_preset(tmp_path):
    """What the compile check compiles is what calls launch: recorded at the first full preset a variant
    supports (forward, backward, the op's specializations, role arguments), every variant launches every
    one of its roles' kernels on its first GPU target. sparse_mla's Gluon pass runs with its dkv atomics in the default
    backward and without them in the deterministic one, in both roles; nsa's BLOCK_T reaches its kernel
    as a run-time chunk, not a constexpr."""
    rows = _script(tmp_path, """
        import json
        import torch
        from kreg.core.device import preset
        from kreg.ops import OPS
        from kreg.ops.catalog import load_all
        from kreg.tuning.compile_check import preset_shapes
        from kreg.tuning.launch_record import meta_calls, record_calls

        for op_name, variants in sorted(load_all().items()):
            for variant in variants:
                device = preset("h200" if variant.vendor == "nvidia" else "mi300x")
                launched, atomics, chunks = set(), set(), set()
                for shape in preset_shapes(op_name, torch.bfloat16, ["full"]).values():
                    calls = meta_calls(op_name, shape, torch.bfloat16)
                    key = dict(OPS[op_name].tuning_key(calls[0]))
                    if not variant.supports(key, device):
                        continue
                    config = variant.default_config(key, device)
                    if launched:
                        break
                    for launch in record_calls(variant, calls, config, device):
                        launched |= launch.roles
                        if "DKV_ATOMICS" in launch.kwargs:
                            atomics.add(("/".join(sorted(launch.roles)), launch.kwargs["DKV_ATOMICS"]))
                        if launch.kernel.fn.__name__ == "_nsa_bwd_cmp_dkv_kernel":
                            chunks.add(("BLOCK_T" in launch.kwargs,
                                        launch.args[launch.kernel.arg_names.index("chunk")]
                                        == config["bwd_cmp_dkv"].blocks["BLOCK_T"]))
                print(json.dumps({"variant": variant.name, "vendor": variant.vendor, "roles": list(variant.roles),
                                  "launched": sorted(launched), "atomics": sorted(atomics), "chunks": sorted(chunks)}))
    """)
    assert len(rows) == sum(len(vs) for vs in load_all().values())
    for row in rows:
        assert set(row["launched"]) == set(row["roles"]), row
        if row["variant"] == "sparse_mla_warpspec":
            assert row["atomics"] == [["bwd_dq/bwd_fused", False], ["bwd_dq/bwd_fused", True]]
        if row["variant"] == "nsa_group_centric":
            assert row["chunks"] == [[False, True]]


def test_recording_takes_only_the_recording_threads_launches(tmp_path):
    """While one thread records, a launch in another thread goes to Triton and is not recorded: its CPU
    tensor fails there (in the driver lookup without a GPU, as a CPU pointer with one)."""
    rows = _script(tmp_path, """
        import json, threading
        import torch
        import triton
        import triton.language as tl
        from kreg.tuning.launch_record import recorded_launches

        @triton.jit
        def _fill(X, BLOCK: tl.constexpr):
            tl.store(X + tl.arange(0, BLOCK), 1.0)

        x = torch.empty(16, device="meta")
        outcome = {}

        def other():
            try:
                _fill[(1,)](torch.empty(16), BLOCK=16)
                outcome["other"] = "ran"
            except Exception as err:
                outcome["other"] = type(err).__name__

        with recorded_launches() as launches:
            _fill[(1,)](x, BLOCK=16)
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        print(json.dumps({"recorded": len(launches), "other": outcome["other"],
                          "restored": triton.runtime.jit.JITFunction.run.__module__}))
    """)
    assert rows[0]["recorded"] == 1 and rows[0]["other"] != "ran"
    assert rows[0]["restored"] == "triton.runtime.jit"


def test_compile_error_is_a_report(tmp_path):
    rows = _script(tmp_path, """
        import json, sys
        import torch
        import triton
        import triton.language as tl
        from kreg.core.device import preset
        from kreg.tuning.compile_check import compile_job
        from kreg.tuning.launch_record import KernelLaunch, recorded_launches, specialize

        @triton.jit
        def _broken_kernel(X, BLOCK: tl.constexpr):
            tl.store(X + tl.arange(0, BLOCK), 1.0)  # arange needs a power of two

        with recorded_launches() as launches:
            _broken_kernel[(1,)](torch.empty(4, device="meta"), BLOCK=3)
        kernel, args, kwargs = launches[0]
        device = preset(sys.argv[1])
        report = compile_job(specialize(KernelLaunch(kernel, args, kwargs, frozenset()), device), device)
        print(json.dumps({"fits": report.fits, "reason": report.reason, "registers": report.registers}))
    """, "mi355x")
    assert rows[0]["fits"] is False and rows[0]["registers"] is None
    assert rows[0]["reason"].startswith("compile_error: ")


def test_interpreted_kernels_cannot_be_recorded():
    """Under the interpreter a launch runs (on CPU tensors) instead of being recorded: the compile check
    lives in processes without TRITON_INTERPRET."""
    if not device_info.interpreter_enabled():
        pytest.skip("kernels here were decorated without TRITON_INTERPRET")
    import torch

    from kreg.ops import OPS
    from kreg.tuning.launch_record import record_calls

    variant = _variant("nvidia")
    op = OPS["flash_attention"]
    args = op.validate(**op.make_inputs(op.presets["tiny"][0], device="cpu", dtype=torch.float16, seed=0))
    config = variant.default_config(dict(op.tuning_key(args)), device_info.CPU)
    assert record_calls(variant, [args], config, device_info.CPU) == []


def test_cli_rejects_a_target_of_another_vendor(capsys):
    with pytest.raises(SystemExit):
        main(["--variant", "flash_attention_tiled", "--vendor", "amd", "--target", "h200"])
    assert "expected a target of vendor amd, got nvidia-h200" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no variant"):
        main(["--variant", "nope", "--vendor", "amd", "--target", "mi300x"])
    with pytest.raises(SystemExit):
        main(["--variant", "flash_attention_tiled", "--vendor", "amd", "--target", "mi300x", "--roles", "split"])
    assert "--roles: flash_attention_tiled has the roles fwd, bwd_pre, bwd_dkv, bwd_dq, got split" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--variant", "flash_attention_tiled", "--vendor", "amd", "--target", "mi300x", "--jobs", "0"])
    assert "--jobs: expected a count of at least 1, got 0" in capsys.readouterr().err


def test_gqa_costs_the_dq_kernel_no_registers():
    """The dQ kernel takes the GQA group as a constexpr: gpt-oss's group of 8 compiles to the registers
    of the same kernel without GQA (as a run-time integer it took 110 against 91 on sm_90, d 64)."""
    shapes = [{"b": 1, "s_q": 8192, "s_k": 8192, "h_q": 64, "h_kv": h_kv, "d": 64, "causal": True, "window": None,
               "sinks": True} for h_kv in (64, 8)]
    rc, rows = _compile_check("--variant", "sink_attention_flash", "--vendor", "nvidia", "--target", "h200",
                              *(arg for shape in shapes for arg in ("--shape-json", json.dumps(shape))),
                              "--roles", "bwd_dq")
    assert rc == 0 and {row["kernel"] for row in rows} == {"_attention_bwd_dq_kernel"}
    registers = {h_kv: sorted(row["registers"] for row in rows if row["key"]["h_kv"] == h_kv) for h_kv in (64, 8)}
    assert registers[64] and registers[64] == registers[8], rows


@pytest.mark.long
def test_attention_window_of_one_compiles():
    """The JIT turns an integer argument equal to 1 into a constant, so a call with window=1 compiles
    the forward and dQ kernels with `window` as a Python int: the mask code must accept one (the
    interpreter never specializes, so only a compile shows it). sm_90 and gfx942, padded and varlen."""
    shape = {"b": 1, "s_q": 1024, "s_k": 1024, "h_q": 8, "h_kv": 2, "d": 64, "causal": True, "window": 1,
             "sinks": True}
    for vendor, target in (("nvidia", "h200"), ("amd", "mi300x")):
        rc, rows = _compile_check("--variant", "sink_attention_flash", "--vendor", vendor, "--target", target,
                                  "--shape-json", json.dumps(shape), "--roles", "fwd,bwd_dq")
        kernels = {row["kernel"] for row in rows}
        assert rc == 0 and kernels == {"_attention_fwd_kernel", "_attention_bwd_dq_kernel"}, rows
        assert all(row["fits"] for row in rows), (target, rows)


@pytest.mark.long
def test_attention_window_without_a_loop_fits_every_target():
    """KEY_LOOPS 2 (a window of 128 keys without a loop) at the gpt-oss window key, 8 and 16 tokens a
    block: no spills, shared memory/LDS within budget on sm_90, gfx942 and gfx950, padded and varlen."""
    shape = {"b": 1, "s_q": 8192, "s_k": 8192, "h_q": 64, "h_kv": 8, "d": 64, "causal": True, "window": 128,
             "sinks": True}
    for vendor, targets, knobs in (("nvidia", "h200", {"num_stages": 2}),
                                   ("amd", "mi300x,mi355x", {"num_stages": 1, "waves_per_eu": 2})):
        configs = [_fwd(blocks={"BLOCK_M": 64, "BLOCK_N": 32, "HEADS": heads, "KEY_LOOPS": 2}, num_warps=4, **knobs)
                   for heads in (8, 4)]
        config_args = [arg for config in configs for arg in ("--config-json", config.to_json())]
        rc, rows = _compile_check("--variant", "sink_attention_flash", "--vendor", vendor, "--target", targets,
                                  "--shape-json", json.dumps(shape), *config_args, "--roles", "fwd")
        assert rc == 0 and {row["arch"] for row in rows} == {device_info.preset(t).arch for t in targets.split(",")}
        assert len(rows) >= 2 * len(configs) * len(targets.split(",")), rows  # padded and varlen at least
        assert all(row["fits"] and row["spills"] == 0 for row in rows), rows
