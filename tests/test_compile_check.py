"""Offline compile checks (no GPU): the flash_attention variants' forward defaults fit sm_90, gfx942 and gfx950.

Compiles run in a subprocess without TRITON_INTERPRET, which conftest sets on machines without a GPU
(an interpreted kernel cannot be compiled).
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
from kreg.tuning.compile_check import compile_config, main

ROOT = Path(__file__).resolve().parents[1]
KEY = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 8, "h_q": 32, "s_k": 8192, "s_q": 8192, "window": None}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _compile_check(*argv: str) -> tuple[int, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "kreg.tuning.compile_check", "--json", *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return proc.returncode, rows


def _variant(vendor: str):
    return next(v for v in load_all()["flash_attention"] if v.vendor == vendor and v.name == "flash_attention_tiled")


def _fwd(**fields) -> CallConfig:
    return CallConfig({"fwd": LaunchConfig(**fields)})


def test_nvidia_default_fits_h200_and_oversized_does_not():
    """Each config compiles twice: padded and packed (varlen) inputs share the key."""
    h200 = device_info.preset("h200")
    default = _variant("nvidia").default_config(KEY, h200)
    huge = _fwd(blocks={"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=5)
    rc, rows = _compile_check("--variant", "flash_attention_tiled", "--vendor", "nvidia", "--target", "h200",
                              "--key-json", json.dumps(KEY), "--config-json", default.to_json(),
                              "--config-json", huge.to_json(), "--roles", "fwd")
    assert rc == 1  # something did not fit
    assert len(rows) == 4 and {r["kernel"] for r in rows} == {"_attention_fwd_kernel"}
    for fit in rows[:2]:
        assert fit["arch"] == "sm_90" and fit["config"] == json.loads(default.to_json())
        assert fit["fits"] and fit["spills"] == 0 and fit["reason"] is None
        assert 0 < fit["registers"] <= 255 and 0 < fit["shared_bytes"] <= h200.shared_mem_bytes
    for big in rows[2:]:
        assert not big["fits"] and big["shared_bytes"] > h200.shared_mem_bytes
        assert "shared memory" in big["reason"]


def test_amd_default_fits_gfx942_and_gfx950_and_lds_overflow_is_caught():
    variant = _variant("amd")
    defaults = {variant.default_config(KEY, device_info.preset(t)).to_json() for t in ("mi300x", "mi355x")}
    assert len(defaults) == 1  # one default for both here, so one call checks it on both targets
    # LDS overflow compiles fine on AMD: only the check against the target's budget catches it.
    wide = _fwd(blocks={"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2, kpack=1)
    rc, rows = _compile_check("--variant", "flash_attention_tiled", "--vendor", "amd", "--target", "mi300x,mi355x",
                              "--key-json", json.dumps(KEY), "--config-json", defaults.pop(),
                              "--config-json", wide.to_json(), "--roles", "fwd")
    assert rc == 1
    by_arch: dict[tuple, list] = {}
    for row in rows:
        by_arch.setdefault((row["arch"], row["config"]["fwd"]["blocks"]["BLOCK_N"]), []).append(row)
    for arch in ("gfx942", "gfx950"):
        assert len(by_arch[arch, 64]) == 2  # padded and varlen
        for row in by_arch[arch, 64]:
            assert row["fits"] and row["spills"] == 0 and row["detail"]["vgpr_spill_count"] == 0, row
            assert 0 < row["registers"] <= 512 and 0 < row["shared_bytes"] <= 65536
    for overflow in by_arch["gfx942", 128]:
        assert not overflow["fits"] and overflow["shared_bytes"] > 65536 and "shared memory" in overflow["reason"]


def test_compile_error_is_a_report(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import triton
        import triton.language as tl
        from kreg import registry
        from kreg.ops.variant import CompileSpec
        from kreg.core.device import preset
        from kreg.tuning.compile_check import compile_config
        from kreg.core.records import CallConfig, LaunchConfig

        @triton.jit
        def _broken_kernel(X, BLOCK: tl.constexpr):
            tl.store(X + tl.arange(0, BLOCK), 1.0)  # arange needs a power of two

        spec = CompileSpec("fwd", _broken_kernel, {"X": "*fp32"}, {"BLOCK": 3})
        report = compile_config(spec, LaunchConfig(), preset(sys.argv[1]))
        print(json.dumps({"fits": report.fits, "reason": report.reason, "registers": report.registers}))
    """))
    # The repo first, then whatever path supplies the dependencies (a GPU machine's carried wheels).
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, str(script), "mi355x"], cwd=ROOT, env={**_env(), "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["fits"] is False and report["registers"] is None
    assert report["reason"].startswith("compile_error: ")


def test_interpreted_kernels_are_refused_in_process():
    if not device_info.interpreter_enabled():
        pytest.skip("kernels here were decorated without TRITON_INTERPRET")
    spec = _variant("amd").compile_specs(KEY, _fwd(blocks={"BLOCK_M": 64, "BLOCK_N": 32}))[0]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_config(spec, LaunchConfig(), device_info.preset("mi355x"))


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


def test_integer_values_are_specialized_as_the_jit_does():
    """A value of 1 becomes a constant, a multiple of 16 is marked divisible, others stay plain i32."""
    from kreg.tuning.compile_check import _alignment_attrs, _as_jit_specializes, _full_signature

    # decode's split kernel takes s_q, the GQA group and h_kv as run-time integers (the attention
    # family's kernels take the group as a constexpr).
    decode = next(v for v in load_all()["decode"] if v.vendor == "nvidia")
    key = {"b": 4, "block_size": None, "d": 64, "dtype": "bf16", "h_kv": 16, "h_q": 64, "n": 8192, "paged": False,
           "s_q": 1, "sinks": True, "window": None}
    spec = next(s for s in decode.compile_specs(key, decode.default_config(key, device_info.preset("h200")))
                if s.role == "split")
    assert spec.values == {"s_q": 1, "group": 4, "h_kv": 16} and "s_q" not in spec.constexprs
    specialized = _as_jit_specializes(spec)
    signature = _full_signature(specialized)
    assert specialized.constexprs["s_q"] == 1 and signature["s_q"] == "constexpr"
    names = spec.fn.arg_names
    attrs = _alignment_attrs(specialized, signature)
    assert (names.index("h_kv"),) in attrs and (names.index("group"),) not in attrs
    for value, marked in ((32, True), (24, False)):
        plain = _as_jit_specializes(type(spec)("split", spec.fn, spec.signature, spec.constexprs,
                                               values={**spec.values, "group": value}))
        attrs = _alignment_attrs(plain, _full_signature(plain))
        assert ((names.index("group"),) in attrs) is marked


def test_gqa_costs_the_dq_kernel_no_registers():
    """The dQ kernel takes the GQA group as a constexpr: gpt-oss's group of 8 compiles to the registers
    of the same kernel without GQA (as a run-time integer it took 110 against 91 on sm_90, d 64)."""
    keys = [{**KEY, "d": 64, "h_q": 64, "h_kv": h_kv, "sinks": True} for h_kv in (64, 8)]
    rc, rows = _compile_check("--variant", "sink_attention_flash", "--vendor", "nvidia", "--target", "h200",
                              *(arg for key in keys for arg in ("--key-json", json.dumps(key))), "--roles", "bwd_dq")
    assert rc == 0 and [row["key"]["h_kv"] for row in rows] == [64, 64, 8, 8]  # padded, then varlen
    assert {row["kernel"] for row in rows} == {"_attention_bwd_dq_kernel"}
    registers = [row["registers"] for row in rows]
    assert registers[:2] == registers[2:], rows


def test_attention_window_of_one_compiles(tmp_path):
    """The JIT turns an integer argument equal to 1 into a constant, so a call with window=1 compiles
    the forward and dQ kernels with `window` as a Python int: the mask code must accept one (the
    interpreter never specializes, so only a compile shows it). sm_90 and gfx942, padded and varlen."""
    script = tmp_path / "window_one.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from kreg.ops.variant import CompileSpec
        from kreg.kernels.common.attention import attention_compile_specs
        from kreg.core.device import preset
        from kreg.tuning.compile_check import compile_config
        from kreg.core.records import CallConfig, LaunchConfig

        key = {"causal": True, "d": 64, "dtype": "bf16", "h_kv": 2, "h_q": 8, "s_k": 1024, "s_q": 1024,
               "window": 1, "sinks": True}
        configs = {"fwd": LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 32, "HEADS": 2, "KEY_LOOPS": 1},
                                       num_warps=4, num_stages=2),
                   "bwd_dq": LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)}
        for spec in attention_compile_specs(key, CallConfig(configs), ("fwd", "bwd_dq"), "bf16"):
            signature = {name: kind for name, kind in spec.signature.items() if name != "window"}
            one = CompileSpec(spec.role, spec.fn, signature, {**spec.constexprs, "window": 1}, spec.options)
            report = compile_config(one, configs[spec.role], preset(sys.argv[1]))
            print(json.dumps({"role": spec.role, "fits": report.fits, "reason": report.reason}))
    """))
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    for target in ("h200", "mi300x"):
        proc = subprocess.run([sys.executable, str(script), target], cwd=ROOT, env={**_env(), "PYTHONPATH": path},
                              capture_output=True, text=True, timeout=300)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(rows) == 4, proc.stderr[-3000:]
        assert all(row["fits"] for row in rows), (target, rows)


def test_attention_window_without_a_loop_fits_every_target():
    """KEY_LOOPS 2 (a window of 128 keys without a loop) at the gpt-oss window key, 8 and 16 tokens a
    block: no spills, shared memory/LDS within budget on sm_90, gfx942 and gfx950, padded and varlen."""
    key = {"causal": True, "d": 64, "dtype": "bf16", "h_kv": 8, "h_q": 64, "s_k": 8192, "s_q": 8192, "sinks": True,
           "window": 128}
    for vendor, targets, knobs in (("nvidia", "h200", {"num_stages": 2}),
                                   ("amd", "mi300x,mi355x", {"num_stages": 1, "waves_per_eu": 2})):
        configs = [_fwd(blocks={"BLOCK_M": 64, "BLOCK_N": 32, "HEADS": heads, "KEY_LOOPS": 2}, num_warps=4, **knobs)
                   for heads in (8, 4)]
        config_args = [arg for config in configs for arg in ("--config-json", config.to_json())]
        rc, rows = _compile_check("--variant", "sink_attention_flash", "--vendor", vendor, "--target", targets,
                                  "--key-json", json.dumps(key), *config_args, "--roles", "fwd")
        assert rc == 0 and len(rows) == 4 * len(targets.split(",")), rows
        assert all(row["fits"] and row["spills"] == 0 for row in rows), rows
