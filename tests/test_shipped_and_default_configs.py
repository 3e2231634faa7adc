"""Every variant's default call configs (at its op's full preset keys) and every shipped tuned call
config compile for their targets with no spills and within shared memory/LDS: sm_90 for NVIDIA
variants, gfx942 and gfx950 for AMD ones; every kernel the calls launch, forward and backward, in every
specialization (`tuning.launch_record`). One compile-check process per variant, defaults and tables
together (a kernel both use compiles once). Compiles run in a subprocess without TRITON_INTERPRET."""


import pytest

from kreg.ops.catalog import load_all
from kreg.tuning.compile_check import shipped_configs
from kreg.tuning_db.table_files import shipped_tables

from .conftest import run_compile_check

TARGETS = {"nvidia": "h200", "amd": "mi300x,mi355x"}
ALL = sorted((v for vs in load_all().values() for v in vs), key=lambda v: (v.op, v.name, v.vendor))
# Only variants that shipped tables name are checked against tables: an empty check would pass having
# checked nothing.
TABLES = {(v.name, v.vendor) for v in ALL if shipped_configs(v)}


@pytest.mark.long
@pytest.mark.parametrize("variant", ALL, ids=[f"{v.name}-{v.vendor}" for v in ALL])
def test_configs_compile_without_spills(variant):
    with_tables = (variant.name, variant.vendor) in TABLES
    proc, rows = run_compile_check("--variant", variant.name, "--vendor", variant.vendor, "--target",
                                   TARGETS[variant.vendor], "--defaults", *(["--tables"] if with_tables else []),
                                   timeout=1500)
    unfit = [(r["arch"], r["source"], r["key"], r["config"], r["kernel"], r["reason"]) for r in rows if not r["fits"]]
    assert proc.returncode == 0 and not unfit, unfit or proc.stderr[-2000:]
    assert rows and all(r["spills"] == 0 for r in rows), proc.stderr[-2000:]
    assert {r["source"] for r in rows} == ({"default", "table"} if with_tables else {"default"})
    # Every role's kernel was compiled, for every target (and any kernel a variant hands calls to).
    kernels = {kernel.fn.__name__ for kernel in variant.kernels.values()}
    for arch in {r["arch"] for r in rows}:
        assert kernels <= {r["kernel"] for r in rows if r["arch"] == arch}
    assert len({r["arch"] for r in rows}) == len(TARGETS[variant.vendor].split(","))


def test_every_variant_a_table_names_has_its_tables_compiled():
    named = {(t.variant, t.variant_vendor) for t in shipped_tables().tuned()}
    assert named == TABLES and named <= {(v.name, v.vendor) for v in ALL}
