"""AMD defaults against a compile-only resource report (tuning.resources.default_problems): the default
a variant runs at a key must compile without spills and have the best estimated occupancy among the
configs of its role that did. Checked here on rows made for the decode variant's real defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kreg.core.device import preset
from kreg.core.records import canonical_json
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.tuning.engine import shape_key
from kreg.tuning.resources import default_problems

MI355X = preset("mi355x")
ROOT = Path(__file__).resolve().parent.parent


def _rows(occupancies: dict[str, float], spills: dict[str, int] | None = None) -> tuple[list[dict], str, str]:
    """Report rows of decode's split role at its first tiny key: the default's config and one other,
    with these occupancies and spills; and the two config strings."""
    key = shape_key(OPS["decode"], OPS["decode"].presets["tiny"][0], torch.bfloat16)
    variant = next(v for v in load_all()["decode"] if v.vendor == "amd")
    default = variant.default_config(key, MI355X)["split"]
    other = default.model_copy(update={"blocks": {**default.blocks, "BLOCK_N": default.blocks["BLOCK_N"] // 2}})
    names = {"default": str(default), "other": str(other)}
    rows = [{"op": "decode", "tuning_key": canonical_json(key), "variant": variant.name, "role": "split",
             "config": names[which], "status": "ok", "registers": 128, "spills": (spills or {}).get(which, 0),
             "shared_bytes": 0, "warps_per_unit": 8, "occupancy": occupancy, "limited_by": "registers",
             "reason": None} for which, occupancy in occupancies.items()]
    return rows, names["default"], names["other"]


def test_a_default_with_the_best_occupancy_and_no_spills_passes():
    rows, _, _ = _rows({"default": 0.5, "other": 0.5})
    assert default_problems(rows, load_all(), MI355X) == []


def test_a_config_with_a_better_occupancy_is_named():
    rows, default, other = _rows({"default": 0.25, "other": 0.5})
    (problem,) = default_problems(rows, load_all(), MI355X)
    assert default in problem and f"{other} 0.5 without spills" in problem


def test_a_spilling_default_is_named_and_a_spilling_rival_does_not_count():
    rows, default, _ = _rows({"default": 0.25, "other": 0.5}, spills={"other": 64})
    assert default_problems(rows, load_all(), MI355X) == []
    rows, default, _ = _rows({"default": 0.5, "other": 0.25}, spills={"default": 32})
    (problem,) = default_problems(rows, load_all(), MI355X)
    assert default in problem and "32 B of spills" in problem


def test_a_default_missing_from_the_report_is_named():
    rows, default, _ = _rows({"other": 0.5})
    (problem,) = default_problems(rows, load_all(), MI355X)
    assert f"the default {default} is not in the report" in problem


def test_compile_only_compiles_a_default_outside_its_space(tmp_path):
    """At a short key the tiled attention's dK/dV default is cut to tiles its space's keep rule leaves out;
    the report still has it, since it is what dispatch runs there (a compile in its own process: the
    tests' interpreter cannot compile)."""
    from kreg.tuning_db.store import TuningStore

    op = OPS["flash_attention"]
    key = shape_key(op, op.presets["tiny"][2], torch.bfloat16)
    variant = next(v for v in load_all()["flash_attention"] if v.vendor == "amd")
    default = variant.default_config(key, MI355X)["bwd_dkv"]
    assert default not in variant.space(key, MI355X)["bwd_dkv"]
    db = f"sqlite:///{tmp_path / 'r.db'}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kreg.tuning.sweep", "--device", "mi355x", "--compile-only", "--op",
                           "flash_attention", "--shapes", "tiny:2", "--roles", "bwd_dkv", "--sample", "0", "--db", db,
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    compiled = {(t.variant, str(t.config["bwd_dkv"]), t.status) for t in TuningStore(db).trials()}
    assert compiled == {(variant.name, str(default), "ok")}


def test_the_shipped_resource_reports_describe_the_registered_amd_variants():
    """Every shipped report (`<device>__<op>__resources.csv`, one per target and op) is of its file's target
    and op, names registered AMD variants and their roles, gives registers and an occupancy for what
    compiled, and holds each role's default at each of its keys (what dispatch runs untuned)."""
    import csv

    from kreg.tuning_db.table_files import SHIPPED_TABLES

    paths = sorted(SHIPPED_TABLES.glob("*__resources.csv"))
    assert paths, "no resource report is shipped"
    targets = {preset(name).key: preset(name) for name in ("mi300x", "mi355x")}
    registry = load_all()
    for path in paths:
        device_key, op, _ = path.name.split("__")
        device = targets[device_key]
        variants = {v.name: v for v in registry[op] if v.vendor == "amd"}
        rows = list(csv.DictReader(path.open()))
        assert rows and {r["op"] for r in rows} == {op}, path.name
        assert {r["variant"] for r in rows} <= set(variants), path.name
        for row in rows:
            assert row["role"] in variants[row["variant"]].roles and len(row["source_hash"]) == 16
            if row["status"] == "ok":
                assert int(row["registers"]) > 0 and 0 < float(row["occupancy"]) <= 1, (path.name, row)
        compiled = {(r["tuning_key"], r["variant"], r["role"], r["config"]) for r in rows}
        for key, name in {(r["tuning_key"], r["variant"]) for r in rows}:
            default = variants[name].default_config(json.loads(key), device)
            for role in variants[name].roles:
                assert (key, name, role, str(default[role])) in compiled, (path.name, key, name, role)
