"""The public API: op listing, contracts, dispatch to references and variants, and the config lookup order."""

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from kreg import registry
from kreg.core.device import CPU, detect
from kreg.core.records import CallConfig, LaunchConfig, TunedConfig, canonical_json
from kreg.ops import OPS
from kreg.registry import dispatch

from .conftest import HAS_GPU

# Kernel dispatch runs where kernels run: the GPU's own vendor in bf16, or both vendors through the
# interpreter in fp16 (its bf16 dot is wrong) on CPU tensors.
KERNEL_DEVICE = "cuda" if HAS_GPU else "cpu"
KERNEL_DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
KERNEL_INFO = detect() if HAS_GPU else CPU
VENDORS = [KERNEL_INFO.vendor] if HAS_GPU else ["nvidia", "amd"]

# The ops are the contract modules of ops/ (those that define OP), found without a list.
CONTRACT_FILES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "ops").glob("*.py")
                        if re.search(r"^OP = ", p.read_text(), re.M))


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """Each test resolves keys anew against its own (empty) database."""
    registry.clear_caches()
    yield
    registry.clear_caches()


def _tiny_args(op_name: str, index: int = 0, dtype=torch.float16, device="cpu") -> dict:
    op = OPS[op_name]
    return op.make_inputs(op.presets["tiny"][index], device=device, dtype=dtype, seed=11)


def _kernel_args(op_name: str, dtype=KERNEL_DTYPE) -> dict:
    return _tiny_args(op_name, dtype=dtype, device=KERNEL_DEVICE)


def test_ops_are_the_contract_modules_in_name_order():
    assert registry.ops() == CONTRACT_FILES == sorted(OPS)
    assert len(CONTRACT_FILES) >= 8


@pytest.mark.parametrize("op", CONTRACT_FILES)
def test_describe_prints_contract_and_variants(op, capsys):
    text = registry.describe(op)
    printed = capsys.readouterr().out
    assert text in printed
    assert f"{op}(" in text and "Variants:" in text and "nvidia:" in text and "amd:" in text
    assert OPS[op].validate.__doc__.strip().splitlines()[0] in text


@pytest.mark.parametrize("op", CONTRACT_FILES)
def test_cpu_call_runs_the_reference(op):
    kwargs = _tiny_args(op)
    got = registry.get(op)(**kwargs)
    want = OPS[op].reference(**OPS[op].validate(**kwargs))
    got_t = [got] if isinstance(got, torch.Tensor) else list(got)
    want_t = [want] if isinstance(want, torch.Tensor) else list(want)
    assert len(got_t) == len(want_t)
    for a, b in zip(got_t, want_t, strict=True):
        assert torch.equal(a, b)


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="op: expected one of"):
        registry.get("dense_mla")
    with pytest.raises(ValueError, match="vendor"):
        registry.get("flash_attention", vendor="intel")
    with pytest.raises(ValueError, match="variant"):
        registry.get("flash_attention", vendor=VENDORS[0], variant="nope")(**_kernel_args("flash_attention"))
    with pytest.raises(ValueError, match="op: expected one of"):
        registry.describe("nope")


def test_bad_arguments_name_the_argument():
    kwargs = _tiny_args("sparse_mla")
    with pytest.raises(TypeError, match="indices"):
        registry.get("sparse_mla")(**{**kwargs, "indices": kwargs["indices"].long()})
    with pytest.raises(ValueError, match="q"):
        registry.get("flash_attention")(torch.randn(3, 4, 64), torch.randn(3, 4, 64), torch.randn(3, 4, 64))


@pytest.mark.parametrize("vendor", VENDORS)
def test_forced_vendor_runs_the_triton_variant(vendor):
    kwargs = _kernel_args("flash_attention")
    handle = registry.get("flash_attention", vendor=vendor)
    choice = handle.choice(**kwargs)
    assert choice.variant is not None and choice.variant.vendor == vendor and choice.source == "default"
    from kreg.ops.testing import TOLERANCE, assert_close

    assert_close(handle(**kwargs), OPS["flash_attention"].reference(**OPS["flash_attention"].validate(**kwargs)),
                 TOLERANCE[KERNEL_DTYPE])


def test_forced_vendor_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    handle = dispatch.OpHandle(OPS["flash_attention"], "nvidia", None)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        handle(**_tiny_args("flash_attention"))


def test_fp32_inputs_fall_back_to_the_reference_with_a_warning():
    kwargs = _kernel_args("flash_attention", dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="running the PyTorch reference"):
        out = registry.get("flash_attention", vendor=VENDORS[0])(**kwargs)
    assert torch.equal(out, OPS["flash_attention"].reference(**OPS["flash_attention"].validate(**kwargs)))


def _key_json(op_name: str, kwargs: dict) -> tuple[dict, str]:
    op = OPS[op_name]
    dims = dict(op.tuning_key(op.validate(**kwargs)))
    return dims, canonical_json(dims)


def _tuned(op: str, key_json: str, config: LaunchConfig, variant: str = "flash_attention_tiled",
           vendor: str | None = None) -> TunedConfig:
    from kreg.ops.catalog import load_all

    source = next(v.source_hash for v in load_all()[op] if v.name == variant)
    return TunedConfig(op=op, device_key=KERNEL_INFO.key, tuning_key=key_json, variant=variant, vendor=vendor,
                       source_hash=source, config=CallConfig({"fwd": config}), time_ms=1.0, triton_version="3.6.0",
                       torch_version=torch.__version__)


def test_lookup_order_database_then_tables_then_nearest_then_default(tmp_path, monkeypatch):
    from kreg.tuning.export import export_json

    kwargs = _kernel_args("flash_attention")
    dims, key_json = _key_json("flash_attention", kwargs)
    handle = registry.get("flash_attention", vendor=VENDORS[0])
    assert handle.choice(**kwargs).source == "default"

    # Shipped tables: a table exported from another database, placed in the tables folder.
    other = __import__("kreg.tuning_db.store", fromlist=["TuningStore"]).TuningStore(f"sqlite:///{tmp_path / 'o.db'}")
    shipped = LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 32, "HEADS": 1, "KEY_LOOPS": 3}, num_warps=4, num_stages=2)
    other.upsert_tuned(_tuned("flash_attention", key_json, shipped), KERNEL_INFO)
    tables = tmp_path / "tables"
    export_json(other, KERNEL_INFO.key, "flash_attention", tables)
    from kreg.tuning_db import table_files

    monkeypatch.setattr(table_files.ShippedTables, "__init__",
                        lambda self, folder=None, _init=table_files.ShippedTables.__init__: _init(self, tables))
    registry.clear_caches()
    choice = handle.choice(**kwargs)
    assert (choice.source, choice.config["fwd"]) == ("tables", shipped)

    # The user's database wins over shipped tables.
    mine = LaunchConfig(blocks={"BLOCK_M": 32, "BLOCK_N": 16, "HEADS": 1, "KEY_LOOPS": 3}, num_warps=4, num_stages=2)
    dispatch.user_store().upsert_tuned(_tuned("flash_attention", key_json, mine), KERNEL_INFO)
    registry.clear_caches()
    choice = handle.choice(**kwargs)
    assert (choice.source, choice.config["fwd"]) == ("database", mine)

    # A key never tuned takes the nearest tuned key (same heads/dims, closest lengths).
    longer = {**kwargs, **{name: torch.randn(2, 70, heads, 64).to(KERNEL_DEVICE, KERNEL_DTYPE)
                           for name, heads in (("q", 4), ("k", 2), ("v", 2))}}
    choice = handle.choice(**longer)
    assert (choice.source, choice.config["fwd"]) == ("nearest-database", mine)

    # An entry of the other vendor's variant of the same name (tuned in the interpreter, device "cpu")
    # is never launched for this vendor.
    if not HAS_GPU:
        other_vendor = "amd" if VENDORS[0] == "nvidia" else "nvidia"
        theirs = LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 1, "KEY_LOOPS": 3})
        dispatch.user_store().upsert_tuned(_tuned("flash_attention", key_json, theirs, vendor=other_vendor),
                                           KERNEL_INFO)
        registry.clear_caches()
        choice = handle.choice(**kwargs)
        assert choice.source == "tables" and choice.config["fwd"] == shipped


def test_later_calls_do_not_touch_the_database(monkeypatch):
    from kreg.tuning_db.store import TuningStore

    calls = []
    original = TuningStore.best
    monkeypatch.setattr(TuningStore, "best", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    kwargs = _kernel_args("flash_attention")
    handle = registry.get("flash_attention", vendor=VENDORS[-1])
    for _ in range(3):
        handle(**kwargs)
    assert len(calls) == 1


def test_corrupted_database_warns_and_still_runs(tmp_path, monkeypatch):
    bad = tmp_path / "broken.db"
    bad.write_bytes(b"this is not a database at all" * 200)
    monkeypatch.setenv("KREG_TUNING_DB", f"sqlite:///{bad}")
    registry.clear_caches()
    kwargs = _kernel_args("flash_attention")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch._warned.clear()
        choice = registry.get("flash_attention", vendor=VENDORS[0]).choice(**kwargs)
    assert choice.source == "default"
    assert any("tuning database unusable" in str(w.message) and str(bad) in str(w.message) for w in caught)


def test_shipped_tables_are_valid_and_name_known_variants():
    from kreg.ops.catalog import load_all
    from kreg.tuning_db.table_files import ShippedTables

    names = {(v.op, v.name) for vs in load_all().values() for v in vs}
    tables = ShippedTables()
    for tuned in tables.tuned():
        assert (tuned.op, tuned.variant) in names
        assert json.loads(tuned.tuning_key)


def test_source_hash_ignores_documentation_but_not_code():
    """Tuned configs go stale when a kernel's code changes, not when its comments or docstrings do."""
    from kreg.ops.variant import code_fingerprint

    source = '"""Module doc."""\n\ndef kernel(x):\n    """Doc."""\n    # why\n    return x * 2\n'
    documented = source.replace("Doc.", "Longer doc.").replace("# why", "# the reason, reworded")
    changed = source.replace("x * 2", "x * 3")
    assert code_fingerprint(documented) == code_fingerprint(source)
    assert code_fingerprint(changed) != code_fingerprint(source)
    # The same on every Python: no ast.dump, whose output gains fields between versions (3.12 added
    # type_params), and these bytes are what tables shipped from 3.12 GPU hosts were keyed with.
    assert code_fingerprint(source) == (
        b"Module(body=[FunctionDef(name='kernel',args=arguments(args=[arg(arg='x')]),"
        b"body=[Return(value=BinOp(left=Name(id='x',ctx=Load()),op=Mult(),right=Constant(value=2)))])])")


def test_any_layer_imports_first_without_a_cycle():
    """Contracts and devices sit below kernels, the catalog between, dispatch on top: any module can be
    the first one a process imports, and the registry package hides no cycle behind a module
    __getattr__ (`registry.get` is a plain attribute from the start)."""
    import subprocess
    import sys
    from pathlib import Path

    modules = ["kreg.kernels.nvidia.sparse_mla", "kreg.kernels.amd.flash_attention",
               "kreg.kernels.common.sparse_mla.variant", "kreg.ops.variant", "kreg.ops.sparse_mla", "kreg.core.device",
               "kreg.registry.dispatch", "kreg.tuning.sweep", "kreg.layers.gated_sparse_attention",
               "kreg.kernels.common.gsa_layer"]
    check = ("import importlib, sys; importlib.import_module(sys.argv[1]); import registry; "
             "assert 'get' in vars(registry) and '__getattr__' not in vars(registry); "
             "assert registry.variants('sparse_mla')")
    root = Path(__file__).resolve().parents[1]
    procs = {m: subprocess.Popen([sys.executable, "-c", check, m], cwd=root, stderr=subprocess.PIPE, text=True)
             for m in modules}
    for module, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"importing {module} first: {err[-2000:]}"


def test_source_hash_covers_kernel_code_only(tmp_path, monkeypatch):
    """A variant's hash is its kernels' code (and the jitted helpers and constexpr globals they use):
    comments, docstrings, launchers, spaces and other kernels do not change it."""
    import importlib
    import textwrap

    from kreg.ops.variant import kernel_fingerprints

    source = textwrap.dedent('''
        import triton
        import triton.language as tl

        SCALE = tl.constexpr(2)

        @triton.jit
        def _helper(x):
            return x * SCALE

        @triton.jit
        def _kernel(X, BLOCK: tl.constexpr):
            """Doc."""
            offs = tl.arange(0, BLOCK)  # why
            tl.store(X + offs, _helper(tl.load(X + offs)))

        def launcher(x):
            return _kernel[(1,)](x, BLOCK=16)
    ''')
    monkeypatch.syspath_prepend(str(tmp_path))

    def fingerprint(name: str, text: str) -> list[bytes]:
        (tmp_path / f"{name}.py").write_text(text)
        return kernel_fingerprints([importlib.import_module(name)._kernel])

    base = fingerprint("hash_base", source)
    assert len(base) == 3  # the kernel, its helper, the constexpr it reads
    assert fingerprint("hash_docs", source.replace('"""Doc."""', '"""Other words."""')
                       .replace("# why", "# because")) == base
    assert fingerprint("hash_launcher", source.replace("BLOCK=16", "BLOCK=32")) == base
    assert fingerprint("hash_helper", source.replace("x * SCALE", "x + SCALE")) != base
    assert fingerprint("hash_constexpr", source.replace("tl.constexpr(2)", "tl.constexpr(3)")) != base

    from kreg.ops.catalog import load_all

    by_name = {(v.name, v.vendor): v for v in load_all()["sparse_mla"]}
    headblock, warpspec = by_name["sparse_mla_headblock", "nvidia"], by_name["sparse_mla_warpspec", "nvidia"]
    assert headblock.source_hash == by_name["sparse_mla_headblock", "amd"].source_hash  # one kernel body
    assert warpspec.source_hash != headblock.source_hash  # its own forward kernel
    assert warpspec.kernels["bwd_dkv"] is headblock.kernels["bwd_dkv"]  # the same deterministic dkv pass
