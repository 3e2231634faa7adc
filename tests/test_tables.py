"""Tuned tables: JSON/CSV/Markdown export, validated import, shipped tables, and the two CLIs."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kreg.tuning_db.table_files as table_files_module
from kreg.core.device import preset
from kreg.core.records import CallConfig, TunedConfig, canonical_json
from kreg.tuning.export import export_csv, export_json, export_markdown, resolve_device, write_atomic
from kreg.tuning.export import main as export_main
from kreg.tuning.load import load_table
from kreg.tuning_db.store import TuningStore
from kreg.tuning_db.table_files import ShippedTables, TableError, read_table

REPO = Path(__file__).resolve().parent.parent
H200 = preset("h200")
MI355X = preset("mi355x")
VARIANTS = {"sparse_mla": "sparse_mla_headblock", "decode": "decode_splitkv"}


def random_entries(device, op: str, n: int, rng: random.Random) -> list[TunedConfig]:
    """`n` tuned entries with distinct keys, each a random config of the first role of a registered
    variant, drawn from its space on `device` (AMD knobs on AMD devices): what `tuning.load` accepts."""
    from kreg.ops.catalog import load_all

    variant = next(v for v in load_all()[op] if v.vendor == device.vendor and v.name == VARIANTS[op])
    out = []
    for i in range(n):
        dims = {"h_q": rng.choice([16, 64, 128]), "d_qk": 576, "topk": 2048, "s_q": 1 << (4 + i),
                "dtype": "bfloat16", "causal": rng.random() < 0.5}
        space = variant.spaces[variant.roles[0]]
        config = CallConfig({variant.roles[0]: space.make({name: rng.choice(values)
                                                           for name, values in space.values(device).items()})})
        out.append(TunedConfig(op=op, device_key=device.key, tuning_key=canonical_json(dims), variant=variant.name,
                               source_hash=f"{rng.getrandbits(64):016x}", config=config,
                               time_ms=None if i == 2 else rng.uniform(0.001, 20.0),
                               triton_version="3.6.0", torch_version=rng.choice(["2.13.0", "2.12.1"])))
    return out


def without_time(entries):
    dumps = [t.model_dump(exclude={"updated_at"}) for t in entries]
    return sorted(dumps, key=lambda d: (d["op"], d["tuning_key"]))


@pytest.fixture
def filled(tmp_path):
    """A database with two ops tuned on h200 and one on mi355x; returns (store, {(device, op): entries})."""
    db = TuningStore(f"sqlite:///{tmp_path / 'source.db'}")
    rng = random.Random()
    entries = {(H200.key, "sparse_mla"): random_entries(H200, "sparse_mla", 7, rng),
               (H200.key, "decode"): random_entries(H200, "decode", 4, rng),
               (MI355X.key, "sparse_mla"): random_entries(MI355X, "sparse_mla", 5, rng)}
    for (device_key, _), rows in entries.items():
        db.import_tuned(rows, H200 if device_key == H200.key else MI355X)
    yield db, entries
    db.close()


def test_json_export_adds_to_the_table_already_there(filled, tmp_path):
    """A store that re-tuned some keys, exported over a folder of tables, replaces those keys and keeps the
    file's others (a fresh store must not empty the shipped tables); a file there that is not a table of
    the same op and device is refused and left as it was."""
    db, entries = filled
    folder = tmp_path / "tables"
    (shipped,) = export_json(db, "h200", op="sparse_mla", out_dir=folder)
    old = entries[(H200.key, "sparse_mla")]
    retuned = old[3].model_copy(update={"time_ms": 0.5, "source_hash": "0123456789abcdef"})
    partial = TuningStore(f"sqlite:///{tmp_path / 'partial.db'}")
    partial.import_tuned([retuned], H200)
    assert export_json(partial, "h200", out_dir=folder) == [shipped]
    merged = {t.tuning_key: t for t in read_table(shipped).tuned()}
    assert set(merged) == {t.tuning_key for t in old}
    assert merged[retuned.tuning_key].time_ms == 0.5 and merged[retuned.tuning_key].source_hash == "0123456789abcdef"
    assert without_time([t for k, t in merged.items() if k != retuned.tuning_key]) == without_time(
        [t for t in old if t.tuning_key != retuned.tuning_key])

    for text in ("{not json", json.dumps({**json.loads(shipped.read_text()), "op": "decode"})):
        shipped.write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(shipped))):
            export_json(partial, "h200", out_dir=folder)
        assert shipped.read_text() == text


@pytest.fixture
def table_file(filled, tmp_path) -> Path:
    """The exported h200 sparse_mla table."""
    db, _ = filled
    paths = export_json(db, "h200", out_dir=tmp_path / "out")
    return next(p for p in paths if p.name.endswith("sparse_mla.json"))


# ----------------------------------------------------------------------------- export
def test_json_export_and_load_round_trip(filled, tmp_path):
    db, entries = filled
    paths = export_json(db, "h200", out_dir=tmp_path / "tables")
    assert sorted(p.name for p in paths) == ["nvidia-h200__decode.json", "nvidia-h200__sparse_mla.json"]
    assert sorted(os.listdir(tmp_path / "tables")) == sorted(p.name for p in paths)  # no temp files left

    data = json.loads(paths[1].read_text())
    assert data["format"] == 2 and data["op"] == "sparse_mla"
    assert data["device"] == {"key": "nvidia-h200", "vendor": "nvidia", "arch": "sm_90", "name": H200.name,
                              "pci_device_id": H200.pci_device_id, "num_sms": H200.num_sms}
    keys = [canonical_json(row["tuning_key"]) for row in data["configs"]]
    assert keys == sorted(keys) and isinstance(data["configs"][0]["tuning_key"], dict)
    assert list(data["configs"][0]["config"]) == ["fwd"]  # a call config by role
    assert "waves_per_eu" not in data["configs"][0]["config"]["fwd"]  # unset AMD knobs are left out

    fresh = TuningStore(f"sqlite:///{tmp_path / 'fresh.db'}")
    assert sum(load_table(p, fresh) for p in paths) == 11
    want = entries[(H200.key, "sparse_mla")] + entries[(H200.key, "decode")]
    assert without_time(fresh.tuned()) == without_time(want)
    assert [(d.key, d.arch, d.name, d.pci_device_id, d.num_sms) for d in fresh.devices()] == [
        (H200.key, H200.arch, H200.name, H200.pci_device_id, H200.num_sms)]
    for tuned in want:
        found = fresh.best(tuned.op, H200, tuned.tuning_key)
        assert found is not None and found.config == tuned.config and found.time_ms == tuned.time_ms
    # Exported again from the fresh database, the files are byte for byte the same.
    again = export_json(fresh, "nvidia-h200", out_dir=tmp_path / "again")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]
    # AMD knobs survive the trip too.
    amd = export_json(db, "mi355", op="sparse_mla", out_dir=tmp_path / "amd")
    assert [p.name for p in amd] == ["amd-mi355x__sparse_mla.json"]
    load_table(amd[0], fresh)
    want = entries[(MI355X.key, "sparse_mla")]
    assert without_time(fresh.tuned(device_key=MI355X.key)) == without_time(want)


def test_csv_and_markdown_hold_every_row(filled):
    db, entries = filled
    want = {t.tuning_key: t for t in entries[(MI355X.key, "sparse_mla")]}
    rows = list(csv.DictReader(io.StringIO(export_csv(db, "amd-mi355x"))))
    assert len(rows) == len(want)  # one row per entry and role; these entries have one role
    for row in rows:
        tuned = want[row["tuning_key"]]
        assert (row["op"], row["device_key"], row["variant"], row["source_hash"], row["role"]) == (
            "sparse_mla", MI355X.key, tuned.variant, tuned.source_hash, "fwd")
        config = tuned.config["fwd"]
        assert {name: int(row[name]) for name in config.blocks} == config.blocks
        for knob in ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack"):
            assert int(row[knob]) == getattr(config, knob)
        assert (float(row["time_ms"]) if row["time_ms"] else None) == tuned.time_ms
        assert (row["triton_version"], row["torch_version"]) == (tuned.triton_version, tuned.torch_version)

    nvidia_rows = list(csv.DictReader(io.StringIO(export_csv(db, "h200", op="decode"))))
    assert len(nvidia_rows) == 4 and all(r["waves_per_eu"] == "" for r in nvidia_rows)

    text = export_markdown(db, "h200")
    lines = text.strip().splitlines()
    assert lines[0].startswith("| op | key | variant | config | time (ms) |")
    assert len(lines) == 2 + 7 + 4
    for tuned in entries[(H200.key, "decode")]:
        dims = " ".join(f"{k}={v}" for k, v in json.loads(tuned.tuning_key).items())
        assert any(dims in line and tuned.variant in line and str(tuned.config) in line for line in lines)


def test_resolve_device():
    assert resolve_device("h200") == ("nvidia-h200", H200)
    assert resolve_device("mi355") == ("amd-mi355x", MI355X)
    assert resolve_device("nvidia-h200") == ("nvidia-h200", H200)
    assert resolve_device("amd-mi325x") == ("amd-mi325x", None)
    with pytest.raises(ValueError, match="device"):
        resolve_device("H 200!")


def test_write_atomic_never_leaves_half_a_file(tmp_path, monkeypatch):
    target = tmp_path / "t.json"
    write_atomic(target, "old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, "new\n" * 1000)
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["t.json"]


# ----------------------------------------------------------------------------- validated import
def _mutate(rows: list[dict], case: str) -> tuple[int, str]:
    """Break one row of a table's configs; returns (row index, what the error must name)."""
    if case == "bad config value":
        rows[2]["config"]["fwd"]["num_warps"] = 3
        return 2, "config.fwd.num_warps"
    if case == "negative block":
        rows[5]["config"]["fwd"]["blocks"]["BLOCK_H"] = -16
        return 5, "config.fwd.blocks"
    if case == "bad role name":
        rows[3]["config"]["Backward!"] = rows[3]["config"]["fwd"]
        return 3, "role names"
    if case == "missing field":
        del rows[1]["variant"]
        return 1, "variant"
    if case == "key not an object":
        rows[3]["tuning_key"] = "[128, 576]"
        return 3, "tuning_key"
    if case == "key is a list":
        rows[4]["tuning_key"] = [128, 576]
        return 4, "tuning_key"
    if case == "wrong type":
        rows[0]["time_ms"] = "fast"
        return 0, "time_ms"
    if case == "number as text":
        rows[6]["config"]["fwd"]["num_stages"] = "2"
        return 6, "config.fwd.num_stages"
    if case == "unknown field":
        rows[1]["speedup"] = 2.0
        return 1, "speedup"
    if case == "repeated key":
        rows[4]["tuning_key"] = rows[0]["tuning_key"]
        return 4, "tuning_key"
    raise AssertionError(case)


CASES = ["bad config value", "negative block", "bad role name", "missing field", "key not an object", "key is a list",
         "wrong type", "number as text", "unknown field", "repeated key"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_row_rejects_the_whole_file(table_file, tmp_path, case):
    data = json.loads(table_file.read_text())
    row, field = _mutate(data["configs"], case)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    target = TuningStore(f"sqlite:///{tmp_path / 'target.db'}")
    kept = random_entries(H200, "sparse_mla", 3, random.Random())
    target.import_tuned(kept, H200)
    before = without_time(target.tuned())
    with pytest.raises(TableError) as info:
        load_table(bad, target)
    message = str(info.value)
    assert str(bad) in message and f"row {row} (configs[{row}])" in message and field in message
    assert without_time(target.tuned()) == before


def test_format_1_tables_still_load(table_file, tmp_path):
    """A table written before kernel roles (format 1: one launch config per entry, no vendor) loads,
    each config read as the forward's."""
    data = json.loads(table_file.read_text())
    data["format"] = 1
    for row in data["configs"]:
        row["config"] = row["config"]["fwd"]
        del row["vendor"], row["backward_ms"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    table = read_table(old)
    new = read_table(table_file)
    assert [e.config for e in table.configs] == [e.config for e in new.configs]
    assert all(e.config.roles() == ("fwd",) and e.vendor is None for e in table.configs)


@pytest.mark.parametrize("content", [b"", b"op,device\nsparse_mla,h200\n", b"\xff\xfe\x00garbage", b"[1, 2]",
                                     b'{"format": 2, "op": "x", "device": {}, "configs": []}'])
def test_files_that_are_not_tables(tmp_path, content):
    path = tmp_path / "table.json"
    path.write_bytes(content)
    with pytest.raises(TableError, match=re.escape(str(path))):
        read_table(path)
    with pytest.raises(TableError, match="cannot read"):
        read_table(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- shipped tables
def test_shipped_tables_match_the_store(filled, tmp_path):
    db, entries = filled
    folder = tmp_path / "tables"
    export_json(db, "h200", out_dir=folder)
    export_json(db, "mi355x", out_dir=folder)
    shipped = ShippedTables(folder)
    for (_, op), rows in entries.items():
        for tuned in rows:
            device = H200 if tuned.device_key == H200.key else MI355X
            assert without_time([shipped.best(op, device, tuned.tuning_key)]) == without_time([tuned])
            dims = {**json.loads(tuned.tuning_key), "s_q": 3 * json.loads(tuned.tuning_key)["s_q"] // 2 + 1}
            got, want = shipped.nearest(op, device, dims, ("s_q",)), db.nearest(op, device, dims, ("s_q",))
            assert without_time([got]) == without_time([want])
    h100 = preset("h100")  # another sm_90 model: falls back to the h200 table
    first = entries[(H200.key, "decode")][0]
    assert shipped.best("decode", h100, first.tuning_key).device_key == H200.key
    assert shipped.best("decode", preset("mi300x"), first.tuning_key) is None
    assert len(shipped.tuned()) == 16 and len(shipped.tuned("decode")) == 4
    assert ShippedTables(tmp_path / "nowhere").best("decode", H200, first.tuning_key) is None
    assert ShippedTables().folder == Path(table_files_module.__file__).parent / "tables"


def test_broken_shipped_table_is_left_out_with_a_warning_naming_it(table_file, tmp_path):
    folder = tmp_path / "shipped"
    folder.mkdir()
    (folder / "good.json").write_text(table_file.read_text())
    data = json.loads(table_file.read_text())
    data["configs"][1]["config"]["fwd"]["num_warps"] = 6
    (folder / "nvidia-h200__broken.json").write_text(json.dumps(data))
    shipped = ShippedTables(folder)  # lazy: nothing is read yet
    key = json.dumps(data["configs"][0]["tuning_key"])
    with pytest.warns(RuntimeWarning, match=r"nvidia-h200__broken\.json.*row 1") as caught:
        assert shipped.best("sparse_mla", H200, key) == read_table(table_file).tuned()[0]
        assert shipped.best("sparse_mla", H200, key) is not None  # read once: no second warning
    assert len(caught) == 1


# ----------------------------------------------------------------------------- CLIs
def _cli(*args: str, db_env: str | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if db_env is not None:
        env["KREG_TUNING_DB"] = db_env
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_export_and_load_clis(filled, tmp_path):
    db, entries = filled
    out = tmp_path / "cli"
    result = _cli("kreg.tuning.export", "--device", "h200", "--op", "sparse_mla", "--format", "json", "--out",
                  str(out), db_env=db.url)
    assert result.returncode == 0, result.stderr
    exported = out / "nvidia-h200__sparse_mla.json"
    assert result.stdout.strip() == str(exported) and os.listdir(out) == [exported.name]

    target_url = f"sqlite:///{tmp_path / 'target.db'}"
    result = _cli("kreg.tuning.load", str(exported), "--db", target_url)
    assert result.returncode == 0, result.stderr
    assert "imported 7" in result.stdout
    target = TuningStore(target_url)
    assert without_time(target.tuned()) == without_time(entries[(H200.key, "sparse_mla")])

    data = json.loads(exported.read_text())
    data["configs"][3]["config"]["fwd"]["blocks"]["BLOCK_N"] = 0
    data["configs"][3]["variant"] = "renamed"  # would change the database if the file got in
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = _cli("kreg.tuning.load", str(exported), str(bad), "--db", target_url)
    assert result.returncode == 2
    assert "row 3 (configs[3])" in result.stderr and "config.fwd.blocks" in result.stderr
    assert str(bad) in result.stderr
    assert without_time(target.tuned()) == without_time(entries[(H200.key, "sparse_mla")])
    (tmp_path / "notes.txt").write_text("not json")
    result = _cli("kreg.tuning.load", str(tmp_path / "notes.txt"), db_env=target_url)
    assert result.returncode == 2 and "not a JSON tuned table" in result.stderr


def test_export_cli_formats_and_exit_codes(filled, tmp_path, capsys):
    db, entries = filled
    assert export_main(["--device", "mi355", "--format", "csv", "--db", db.url]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    want = entries[(MI355X.key, "sparse_mla")]
    assert sorted(r["tuning_key"] for r in rows) == sorted(t.tuning_key for t in want)

    assert export_main(["--device", "h200", "--format", "md", "--out", str(tmp_path), "--db", db.url]) == 0
    written = tmp_path / "nvidia-h200.md"
    assert capsys.readouterr().out.strip() == str(written)
    assert written.read_text() == export_markdown(db, "h200")

    assert export_main(["--device", "h100", "--db", db.url]) == 1  # nothing tuned there
    assert "nothing tuned" in capsys.readouterr().err
    assert export_main(["--device", "H 200!", "--db", db.url]) == 2
    assert "device" in capsys.readouterr().err
    broken = tmp_path / "broken.db"
    broken.write_text("not a database\n" * 20)
    assert export_main(["--device", "h200", "--db", f"sqlite:///{broken}"]) == 2
    assert "KREG_TUNING_DB" in capsys.readouterr().err
