"""Hostile data: stores and tables that fail, lie or try to escape, and what kreg guarantees about them.

- Dispatch survives any failure of the tuning database or the shipped tables: it warns once, naming the
  source, and the next source answers (database -> tables -> nearest -> default).
- No message, warning, export or CLI output holds a database URL's password.
- `tuning.load` imports only what the registered variants can launch, all files or none; `tuning.export`
  writes only inside --out and never over a link or a device.
- Malformed JSON, URLs and read-only databases give one clear error, not a traceback; read-only
  commands create no file or folder.

Dispatch runs on the suite's device (a GPU when there is one, else CPU tensors through the interpreter,
`vendor="nvidia"`), with entries keyed by that device and the shipped tables set aside where a test
counts its sources; nothing here launches a kernel except one call that proves a call still runs. The
data tests key their entries by the CPU.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import warnings
from pathlib import Path

import pytest
import torch
from sqlalchemy.dialects import registry as sqlalchemy_dialects
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import make_url

from kreg import registry
from kreg.core.device import CPU, DeviceInfo, detect
from kreg.core.records import CallConfig, LaunchConfig, TunedConfig, canonical_json
from kreg.ops import OPS
from kreg.ops.testing import TOLERANCE, assert_close
from kreg.registry import dispatch
from kreg.tuning.export import ExportError, write_atomic
from kreg.tuning.export import main as export_main
from kreg.tuning.load import load_tables
from kreg.tuning.load import main as load_main
from kreg.tuning.sweep import main as sweep_main
from kreg.tuning_db import table_files
from kreg.tuning_db.errors import TuningDatabaseError, redact, safe_url
from kreg.tuning_db.store import TuningStore
from kreg.tuning_db.table_files import TableError, TableFile, read_table

from .conftest import HAS_GPU

OP = "flash_attention"
VARIANT = "flash_attention_tiled"
DEVICE = "cuda" if HAS_GPU else "cpu"
HERE = detect(DEVICE)  # the device dispatch sees
SECRET = "s3cretPW"
# A password with an unescaped "@" and ":": a parser that misreads it quotes its pieces.
PIECES = ("s3cretPW", "Pw0rdTwo", "Pw0rdThree")
BAD_URLS = {
    "password in the query": f"nosuchdb://kreg@db.example/kreg?sslmode=require&password={SECRET}",
    "unescaped @ and : in the password": f"postgresql+psycopg://kreg:{PIECES[0]}@{PIECES[1]}:{PIECES[2]}@db.example/kreg",
    "malformed port": f"postgresql://kreg:{SECRET}@db.example:notaport/kreg",
    "unknown dialect": f"nosuchdb://kreg:{SECRET}@db.example/kreg",
    "unknown driver": f"postgresql+nosuchdriver://kreg:{SECRET}@db.example/kreg",
    "missing driver module": f"mysql+mysqldb://kreg:{SECRET}@127.0.0.1:1/kreg",
    "not a URL": f"kreg:{SECRET}@db.example/kreg",
    "one slash": "sqlite:/x",
}


class FileDialect(SQLiteDialect_pysqlite):
    """A working database behind a server-style URL (user, password, host): rows live in the SQLite file
    named by the URL's `path` query. It lets a password-bearing URL go through every command."""

    name = "kregfile"
    supports_statement_cache = True

    def create_connect_args(self, url):
        return [url.query["path"]], {}


class RefusingDialect(SQLiteDialect_pysqlite):
    """A server that refuses every connection with a message repeating the connection string, password
    included, as some drivers' messages do."""

    name = "kregrefuse"
    supports_statement_cache = True

    def create_connect_args(self, url):
        return [], {"dsn": url.render_as_string(hide_password=False)}

    def connect(self, *cargs, **cparams):
        raise self.loaded_dbapi.OperationalError(f"connection refused: {cparams['dsn']}")


sqlalchemy_dialects.register("kregfile", __name__, "FileDialect")
sqlalchemy_dialects.register("kregrefuse", __name__, "RefusingDialect")


@pytest.fixture
def no_shipped_tables(tmp_path, monkeypatch):
    """An empty tables folder, so that only the sources a test sets up answer (on a GPU the shipped
    tables of its device would)."""
    empty = tmp_path / "no_tables"
    empty.mkdir()
    monkeypatch.setattr(table_files, "SHIPPED_TABLES", empty)


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """Each test resolves keys anew and sees every warning."""
    registry.clear_caches()
    dispatch._warned.clear()
    yield
    registry.clear_caches()
    dispatch._warned.clear()


def _args(s: int, seed: int = 5) -> dict:
    """flash_attention inputs of length `s` (keys bucket s: 37 -> 64, 100 -> 128), fp16 on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (2, s, 4, 64), "k": (2, s, 2, 64), "v": (2, s, 2, 64)}
    tensors = {name: torch.randn(shape, generator=gen).half().to(DEVICE) for name, shape in shapes.items()}
    return tensors | {"causal": True}


def _key(s: int) -> str:
    op = OPS[OP]
    return canonical_json(dict(op.tuning_key(op.validate(**_args(s)))))


def _tuned(key_json: str, block_m: int = 32, block_n: int = 16, source_hash: str | None = None,
           device: DeviceInfo = CPU) -> TunedConfig:
    from kreg.ops.catalog import load_all

    current = next(v for v in load_all()[OP] if v.name == VARIANT and v.vendor == "nvidia").source_hash
    return TunedConfig(op=OP, device_key=device.key, tuning_key=key_json, variant=VARIANT, vendor="nvidia",
                       source_hash=source_hash or current,
                       config=CallConfig({"fwd": LaunchConfig(blocks={"BLOCK_M": block_m, "BLOCK_N": block_n,
                                                                      "HEADS": 1, "KEY_LOOPS": 3})}),
                       time_ms=0.5, triton_version="3.6.0", torch_version="2.13.0")


def _choice(s: int = 37):
    return registry.get(OP, vendor="nvidia").choice(**_args(s))


def _kreg_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("kreg:")]


def _table(path: Path, entries: list[TunedConfig], device: DeviceInfo = CPU) -> Path:
    path.write_text(TableFile.build(OP, device, entries).to_json())
    return path


def _damage(db: Path, key_json: str, column: str, value) -> None:
    con = sqlite3.connect(db)
    con.execute(f"UPDATE tuned_configs SET {column} = ? WHERE tuning_key = ?", (value, key_json))
    con.commit()
    con.close()


# ============================================================ 1. dispatch survives any store failure
def test_unwritable_cache_dir_runs_calls_and_creates_nothing(tmp_path, monkeypatch, no_shipped_tables):
    """A HOME where no cache folder can be made (a read-only HOME in a container): the default database
    cannot exist, so calls run on defaults and nothing is created."""
    blocker = tmp_path / "home"
    blocker.write_text("a file where the cache folder would go\n")
    monkeypatch.delenv("KREG_TUNING_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    monkeypatch.setenv("HOME", str(blocker))
    before = sorted(tmp_path.rglob("*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _choice().source == "default"
        args = _args(37)
        out = registry.get(OP, vendor="nvidia")(**args)
    op = OPS[OP]
    assert_close(out, op.reference(**op.validate(**args)), TOLERANCE[torch.float16])
    assert _kreg_warnings(caught) == []  # no database yet is the normal state, not a failure
    assert sorted(tmp_path.rglob("*")) == before


DAMAGE = {
    "config not JSON": ("config_json", '{"fwd": {"blocks": {"BLOCK_M": 32,'),
    "config not a config": ("config_json", '{"fwd": {"blocks": {"BLOCK_M": "wide"}}}'),
    "unknown variant": ("variant", "flash_attention_gone"),
    "block not a power of two": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":48,"BLOCK_N":16}}}'),
    "huge block": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":1048576,"BLOCK_N":16}}}'),
    "unknown block": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":32,"BLOCK_Q":16}}}'),
    "unknown role": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":32,"BLOCK_N":16}},"bwd_unknown":{}}'),
    "warps outside the space": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":32,"BLOCK_N":16},"num_warps":64}}'),
    "AMD knob on NVIDIA": ("config_json", '{"fwd":{"blocks":{"BLOCK_M":32,"BLOCK_N":16},"waves_per_eu":2}}'),
    "infinite time": ("time_ms", float("inf")),
    "key not JSON": ("tuning_key", "{not json"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_database_row_warns_once_and_the_next_source_answers(tmp_path, monkeypatch, case, no_shipped_tables):
    """Row A is fine, row B is damaged: B's key falls back to the nearest tuned key (A) with one warning
    naming the database, A's key still comes from the database, and nothing raises."""
    db = tmp_path / "user.db"
    monkeypatch.setenv("KREG_TUNING_DB", f"sqlite:///{db}")
    store = TuningStore()
    good, bad = _tuned(_key(37), 32, 16, device=HERE), _tuned(_key(100), 16, 32, device=HERE)
    store.upsert_tuned(good, HERE)
    store.upsert_tuned(bad, HERE)
    store.close()
    column, value = DAMAGE[case]
    _damage(db, bad.tuning_key, column, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        damaged = _choice(100)
        fine = _choice(37)
        again = registry.get(OP, vendor="nvidia", variant=VARIANT).choice(**_args(100))  # a new handle
    assert (damaged.source, damaged.config["fwd"]) == ("nearest-database", good.config["fwd"])
    assert (fine.source, fine.config["fwd"]) == ("database", good.config["fwd"])
    assert again.source == "nearest-database"
    messages = _kreg_warnings(caught)
    assert len(messages) == 1, messages
    assert str(db) in messages[0] and ("ignored" in messages[0] or "damaged" in messages[0])


def test_damaged_row_is_kept_and_replaced_by_the_next_write(tmp_path):
    """Reads skip a damaged row without deleting it; the next upsert of its key replaces it in place."""
    db = tmp_path / "t.db"
    store = TuningStore(f"sqlite:///{db}")
    entry = _tuned(_key(37))
    store.upsert_tuned(entry, CPU)
    _damage(db, entry.tuning_key, "config_json", "[[[")
    with pytest.warns(RuntimeWarning, match=r"tuned_configs row 1 is damaged"):
        assert store.tuned() == [] and store.best(OP, CPU, entry.tuning_key) is None
    store.upsert_tuned(entry, CPU)
    assert [t.config for t in store.tuned()] == [entry.config]
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM tuned_configs").fetchone()[0] == 1
    con.close()


@pytest.mark.parametrize("breakage", ["not JSON", "config outside its space"])
def test_damaged_shipped_table_warns_once_and_the_rest_answers(tmp_path, monkeypatch, breakage):
    folder = tmp_path / "tables"
    folder.mkdir()
    good = _tuned(_key(37), 16, 32, device=HERE)
    _table(folder / f"{HERE.key}__flash_attention.json", [good], HERE)
    broken = folder / f"{HERE.key}__broken.json"
    if breakage == "not JSON":
        broken.write_text('{"format": 2, "op": ')
        expect = "not a JSON tuned table"
    else:
        _table(broken, [_tuned(_key(100), 48, 16, device=HERE)], HERE)
        expect = "BLOCK_M=48"
    monkeypatch.setattr(table_files, "SHIPPED_TABLES", folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fine = _choice(37)
        other = _choice(100)
        _choice(200)
    assert (fine.source, fine.config["fwd"]) == ("tables", good.config["fwd"])
    assert other.source == "nearest-tables" and other.config["fwd"] == good.config["fwd"]
    messages = _kreg_warnings(caught)
    assert len(messages) == 1, messages
    assert str(folder) in messages[0] and expect in messages[0]


@pytest.mark.parametrize("case", [*BAD_URLS, "refusing server", "directory"])
def test_unusable_database_warns_once_without_the_password_and_calls_run(tmp_path, monkeypatch, case,
                                                                          no_shipped_tables):
    urls = {**BAD_URLS, "refusing server": f"kregrefuse://kreg:{SECRET}@db.example:5432/kreg",
            "directory": f"sqlite:///{tmp_path}"}
    monkeypatch.setenv("KREG_TUNING_DB", urls[case])
    message = _calls_run_with_one_warning()
    assert not any(piece in message for piece in PIECES)


def _calls_run_with_one_warning() -> str:
    """Two keys' calls with the database unusable run on their defaults; the one kreg warning they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _choice(37).source == "default"
        assert _choice(100).source == "default"
    messages = _kreg_warnings(caught)
    assert len(messages) == 1, messages
    assert "tuning database unusable" in messages[0]
    return messages[0]


def test_refusing_postgres_server_warns_once_without_the_password_and_calls_run(postgres_url, monkeypatch,
                                                                                no_shipped_tables):
    """A real server (the PostgreSQL test server) refusing a wrong password: calls run on their defaults,
    with one warning that shows neither the wrong password nor the server's real one."""
    server = make_url(postgres_url)
    monkeypatch.setenv("KREG_TUNING_DB", server.set(password=SECRET).render_as_string(hide_password=False))
    message = _calls_run_with_one_warning()
    assert "password authentication failed" in message
    assert SECRET not in message and server.password not in message


def test_lookups_run_once_per_key(monkeypatch, no_shipped_tables):
    """The checks and lookups are resolution work: a key's later calls touch neither."""
    from kreg.registry import dispatch as dispatch_module

    calls = []
    real = dispatch_module.entry_problem
    monkeypatch.setattr(dispatch_module, "entry_problem", lambda *a: calls.append(1) or real(*a))
    store = dispatch.user_store()
    store.upsert_tuned(_tuned(_key(37), device=HERE), HERE)
    reads = []
    real_best = TuningStore.best
    monkeypatch.setattr(TuningStore, "best", lambda self, *a, **k: reads.append(1) or real_best(self, *a, **k))
    handle = registry.get(OP, vendor="nvidia")
    for _ in range(3):
        assert handle.choice(**_args(37)).source == "database"
    assert len(calls) == 1 and len(reads) == 1


# ============================================================ 2. no secrets in output
@pytest.mark.parametrize("case", BAD_URLS)
def test_bad_urls_are_clear_errors_without_the_password(case):
    with pytest.raises(TuningDatabaseError) as info:
        TuningStore(BAD_URLS[case])
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert not any(piece in message for piece in PIECES) and "KREG_TUNING_DB" in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_refused_connection_is_a_clear_error_without_the_password():
    with pytest.raises(TuningDatabaseError) as info:
        TuningStore(f"kregrefuse://kreg:{SECRET}@db.example:5432/kreg")
    assert "connection refused" in str(info.value) and SECRET not in str(info.value)
    assert "kreg:***@db.example" in str(info.value)


def test_redaction_helpers():
    assert safe_url(f"postgresql://u:{SECRET}@h/db") == "postgresql://u:***@h/db"
    assert SECRET not in safe_url(f"postgresql://u:{SECRET}@h:notaport/db")
    assert safe_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    url = "postgresql://u:p%40ss@h/db"  # the password is "p@ss", written percent-encoded
    assert redact("failed for p@ss and p%40ss", url) == "failed for *** and ***"
    assert redact("nothing to hide", "sqlite:////tmp/x.db") == "nothing to hide"


def _secret_url(tmp_path: Path) -> str:
    return f"kregfile://kreg:{SECRET}@db.example:5432/kreg?path={tmp_path / 'server.db'}"


def test_every_command_keeps_the_password_out_of_its_output(tmp_path, monkeypatch, capsys):
    """A working database behind a password-bearing URL, through load, export (every format, and the
    'nothing tuned' message), sweep --stale and a failing sweep: the password is in no output and no file."""
    url = _secret_url(tmp_path)
    table = _table(tmp_path / "cpu__flash_attention.json", [_tuned(_key(37), source_hash="0000older0000000")])
    assert load_main([str(table), "--db", url]) == 0
    out = tmp_path / "out"
    assert export_main(["--device", "cpu", "--format", "json", "--out", str(out), "--db", url]) == 0
    for fmt in ("csv", "md"):
        assert export_main(["--device", "cpu", "--format", fmt, "--db", url]) == 0
    assert export_main(["--device", "h200", "--db", url]) == 1  # nothing tuned there: names the database
    monkeypatch.setenv("KREG_TUNING_DB", url)
    assert sweep_main(["--device", "cpu", "--stale", "--db", url]) == 0
    refusing = f"kregrefuse://kreg:{SECRET}@db.example:5432/kreg"
    assert sweep_main(["--device", "cpu", "--stale", "--db", refusing]) == 2
    assert load_main([str(table), "--db", refusing]) == 2
    assert export_main(["--device", "cpu", "--db", refusing]) == 2
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "kreg:***@db.example" in text and "0000older0000000" in text and "connection refused" in text
    assert SECRET not in text
    assert all(SECRET not in path.read_text() for path in out.iterdir())
    assert repr(TuningStore(url)) == f"TuningStore('{safe_url(url)}')" and SECRET not in repr(TuningStore(url))


# ============================================================ 3. validated means validated
def _shipped_copy(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the shipped H200 flash_attention table (real data) and its JSON."""
    text = (table_files.SHIPPED_TABLES / "nvidia-h200__flash_attention.json").read_text()
    path = tmp_path / "nvidia-h200__flash_attention.json"
    path.write_text(text)
    return path, json.loads(text)


def _set_fwd(row: dict, **fields) -> None:
    config = row["config"]["fwd"]
    for name, value in fields.items():
        if name.isupper():
            config["blocks"][name] = value
        else:
            config[name] = value


INVALID = {
    "unknown op": (lambda d: d.update(op="no_such_op"), "op 'no_such_op' is not a registered op"),
    "unknown variant": (lambda d: d["configs"][2].update(variant="flash_attention_fast"), "row 2"),
    "other vendor": (lambda d: d["configs"][2].update(vendor="intel"), "row 2"),
    "unknown role": (lambda d: d["configs"][3]["config"].update(bwd_unknown=d["configs"][3]["config"]["fwd"]),
                     "role 'bwd_unknown'"),
    "unknown block": (lambda d: _set_fwd(d["configs"][4], BLOCK_Z=64), "block BLOCK_Z"),
    "non-power-of-two block": (lambda d: _set_fwd(d["configs"][5], BLOCK_N=96), "BLOCK_N=96"),
    "huge block": (lambda d: _set_fwd(d["configs"][6], BLOCK_M=1 << 30), "BLOCK_M=1073741824"),
    "warps outside the space": (lambda d: _set_fwd(d["configs"][7], num_warps=32), "num_warps=32"),
    "stages outside the space": (lambda d: _set_fwd(d["configs"][8], num_stages=9), "num_stages=9"),
    "AMD knob on NVIDIA": (lambda d: _set_fwd(d["configs"][9], kpack=2), "kpack=2"),
    "negative time": (lambda d: d["configs"][1].update(time_ms=-0.5), "time_ms"),
    "huge device count": (lambda d: d["device"].update(num_sms=1 << 40), "num_sms"),
}


@pytest.mark.parametrize("case", INVALID)
def test_load_rejects_what_no_variant_can_launch(tmp_path, capsys, case):
    path, data = _shipped_copy(tmp_path)
    mutate, named = INVALID[case]
    mutate(data)
    path.write_text(json.dumps(data))
    db = tmp_path / "sub" / "target.db"
    assert load_main([str(path), "--db", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tuning.load: ") and len(err.strip().splitlines()) == 1
    assert str(path) in err and named in err
    assert not (tmp_path / "sub").exists()  # nothing written, not even a database file


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_non_finite_times_are_rejected(tmp_path, number):
    path, data = _shipped_copy(tmp_path)
    text = json.dumps(data).replace('"time_ms": ' + json.dumps(data["configs"][0]["time_ms"]),
                                    f'"time_ms": {number}', 1)
    assert number in text
    path.write_text(text)
    with pytest.raises(TableError, match=re.escape(str(path))):
        read_table(path)


def test_the_shipped_tables_pass_the_load_checks(tmp_path):
    """What ships is what load accepts: every shipped file, imported together."""
    files = sorted(table_files.SHIPPED_TABLES.glob("*.json"))
    counts = load_tables(files, TuningStore(f"sqlite:///{tmp_path / 'all.db'}"))
    assert len(counts) == len(files) and all(count > 0 for _, count in counts)


def test_multi_file_load_is_all_or_nothing(tmp_path, monkeypatch):
    first = _table(tmp_path / "a.json", [_tuned(_key(37))])
    second = _table(tmp_path / "b.json", [_tuned(_key(100)), _tuned(_key(200))])
    url = f"sqlite:///{tmp_path / 'db' / 't.db'}"
    real_upsert = TuningStore._upsert
    seen = []

    def failing_upsert(self, session, device_id, tuned):
        seen.append(tuned.tuning_key)
        if tuned.tuning_key == _key(200):  # the second file's last row: the first file is written by now
            raise sqlite3.OperationalError("disk I/O error")
        real_upsert(self, session, device_id, tuned)

    monkeypatch.setattr(TuningStore, "_upsert", failing_upsert)
    assert load_main([str(first), str(second), "--db", url]) == 2
    assert seen == [_key(37), _key(100), _key(200)]
    monkeypatch.setattr(TuningStore, "_upsert", real_upsert)
    assert TuningStore(url).tuned() == []
    # One invalid file: nothing of the valid one either; a key given twice is refused too.
    broken = _table(tmp_path / "c.json", [_tuned(_key(300), 48, 16)])
    assert load_main([str(first), str(broken), "--db", url]) == 2
    twice = _table(tmp_path / "d.json", [_tuned(_key(37), 16, 16)])
    with pytest.raises(TableError, match=r"d\.json: row 0 .* also row 0 of .*a\.json"):
        load_tables([first, twice], TuningStore(url))
    assert TuningStore(url).tuned() == []
    assert load_main([str(first), str(second), "--db", url]) == 0
    assert len(TuningStore(url).tuned()) == 3


HOSTILE_OPS = ["../../escaped", "/tmp/absolute", "a/b", "..", "-rf", "x\x00y\nz", ".hidden", "ok.name"]


def test_export_file_names_are_sanitized_and_stay_in_out(tmp_path):
    """Op names from the database never make a path: every file lands in --out with a safe name."""
    store = TuningStore(f"sqlite:///{tmp_path / 'src.db'}")
    for op in HOSTILE_OPS:  # the store API takes any op name; export must still be safe
        store.upsert_tuned(_tuned(_key(37)).model_copy(update={"op": op}), CPU)
    out = tmp_path / "deep" / "out"
    from kreg.tuning.export import export_json

    written = export_json(store, "cpu", out_dir=out)
    assert len(written) == len(HOSTILE_OPS)
    assert all(path.parent == out for path in written)
    for path in written:
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", path.name) and ".." not in path.name
    assert sorted(tmp_path.rglob("*.json")) == sorted(written)
    assert {p.name for p in tmp_path.iterdir()} <= {"deep", "src.db", "src.db-shm", "src.db-wal"}
    # Two ops that sanitize to one name: refused, nothing written.
    clash = TuningStore(f"sqlite:///{tmp_path / 'clash.db'}")
    for op in ("a/b", "a_b"):
        clash.upsert_tuned(_tuned(_key(37)).model_copy(update={"op": op}), CPU)
    with pytest.raises(ExportError, match="both be written"):
        export_json(clash, "cpu", out_dir=tmp_path / "clash")
    assert not (tmp_path / "clash").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_export_refuses_to_replace_what_is_not_a_regular_file(tmp_path, capsys, kind):
    store = TuningStore(f"sqlite:///{tmp_path / 'src.db'}")
    store.upsert_tuned(_tuned(_key(37)), CPU)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "cpu__flash_attention.json"
    elsewhere = tmp_path / "precious.txt"
    elsewhere.write_text("keep me\n")
    if kind == "symlink":
        target.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    assert export_main(["--device", "cpu", "--out", str(out), "--db", store.url]) == 2
    err = capsys.readouterr().err
    assert "refusing to replace" in err and str(target) in err and len(err.strip().splitlines()) == 1
    assert elsewhere.read_text() == "keep me\n"
    assert {"symlink": target.is_symlink, "fifo": target.is_fifo, "directory": target.is_dir}[kind]()
    assert sorted(p.name for p in out.iterdir()) == [target.name]  # no temporary file left behind
    with pytest.raises(ExportError):
        write_atomic(target, "x")


# ============================================================ 4. clear errors, not tracebacks
def _valid_text() -> str:
    return (table_files.SHIPPED_TABLES / "nvidia-h200__flash_attention.json").read_text()


MALFORMED = {
    "huge float": lambda: _valid_text().replace('"num_sms": 132', '"num_sms": 1e999', 1),
    "5000-digit integer": lambda: _valid_text().replace('"num_sms": 132', '"num_sms": ' + "9" * 5000, 1),
    "integer past 64 bits": lambda: _valid_text().replace('"num_sms": 132', f'"num_sms": {1 << 64}', 1),
    "deep nesting": lambda: "[" * 10000 + "]" * 10000,
    "deep nesting, unclosed": lambda: "[" * 10000,
    "repeated key": lambda: _valid_text().replace('"format": 2,', '"format": 2, "format": 1,', 1),
    "repeated key deep inside": lambda: _valid_text().replace('"BLOCK_M": ', '"BLOCK_N": 16, "BLOCK_M": ', 1),
    "truncated": lambda: _valid_text()[: len(_valid_text()) // 2],
    "empty": lambda: "",
    "NaN literal": lambda: _valid_text().replace('"num_sms": 132', '"num_sms": NaN', 1),
}


@pytest.mark.parametrize("case", [*MALFORMED, "not UTF-8"])
def test_malformed_files_are_one_line_errors(tmp_path, capsys, case):
    path = tmp_path / "table.json"
    if case == "not UTF-8":
        path.write_bytes(_valid_text().encode().replace(b'"NVIDIA', b'"\xff\xfeNVIDIA', 1))
    else:
        text = MALFORMED[case]()
        assert text != _valid_text()
        path.write_text(text)
    with pytest.raises(TableError) as info:
        read_table(path)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value)
    assert load_main([str(path), "--db", f"sqlite:///{tmp_path / 'x.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tuning.load: ") and len(err.strip().splitlines()) == 1 and str(path) in err
    assert not (tmp_path / "x.db").exists()


def test_a_table_that_is_not_a_file_is_refused(tmp_path):
    with pytest.raises(TableError, match="not a tuned table: expected a regular file, got a folder"):
        read_table(tmp_path)
    big = tmp_path / "big.json"
    with big.open("wb") as handle:
        handle.truncate(table_files.MAX_TABLE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(TableError, match="larger than"):
        read_table(big)


@pytest.mark.parametrize("case", BAD_URLS)
def test_bad_urls_are_one_line_cli_errors(tmp_path, capsys, case):
    table = _table(tmp_path / "cpu__flash_attention.json", [_tuned(_key(37))])
    assert load_main([str(table), "--db", BAD_URLS[case]]) == 2
    assert export_main(["--device", "cpu", "--db", BAD_URLS[case]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("tuning.load: ") and err[1].startswith("tuning.export: ")
    assert all("KREG_TUNING_DB" in line and not any(piece in line for piece in PIECES) for line in err)


@pytest.fixture(params=["wal", "delete"])
def read_only_db(tmp_path, request) -> tuple[str, Path, TunedConfig]:
    """A database holding one stale entry, then opened read-only (SQLite's mode=ro: what a file the user
    cannot write gives, whoever runs the tests); its journal mode as a sweep left it, or as a copy made
    with the default journal has it."""
    path = tmp_path / "ro.db"
    entry = _tuned(_key(37), source_hash="0000older0000000", device=HERE)
    store = TuningStore(f"sqlite:///{path}")
    store.upsert_tuned(entry, HERE)
    store.close()
    if request.param == "delete":
        con = sqlite3.connect(path)
        con.execute("PRAGMA journal_mode = DELETE")
        con.close()
    return f"sqlite:///file:{path}?mode=ro&uri=true", path, entry


def test_read_only_database_reads_and_refuses_writes_clearly(read_only_db, tmp_path, monkeypatch, capsys):
    url, path, entry = read_only_db
    before = path.read_bytes()
    store = TuningStore(url)
    assert store.best(OP, HERE, entry.tuning_key).config == entry.config
    assert export_main(["--device", HERE.key, "--out", str(tmp_path / "out"), "--db", url]) == 0
    assert read_table(tmp_path / "out" / f"{HERE.key}__flash_attention.json").tuned()[0].config == entry.config
    monkeypatch.setenv("KREG_TUNING_DB", url)
    assert sweep_main(["--device", HERE.key, "--stale", "--db", url]) == 0
    assert "0000older0000000" in capsys.readouterr().out
    assert _choice(37).source == "database"
    with pytest.raises(TuningDatabaseError, match="readonly.*KREG_TUNING_DB"):
        store.upsert_tuned(_tuned(_key(100), device=HERE), HERE)
    table = _table(tmp_path / "new.json", [_tuned(_key(100), device=HERE)], HERE)
    assert load_main([str(table), "--db", url]) == 2
    err = capsys.readouterr().err
    assert "readonly" in err and len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before
    assert [t.config for t in TuningStore(url).tuned()] == [entry.config]


def test_read_only_commands_create_nothing_on_a_mistyped_path(tmp_path, monkeypatch, capsys, no_shipped_tables):
    typo = tmp_path / "tpyo" / "deeper" / "tuning.db"
    url = f"sqlite:///{typo}"
    assert export_main(["--device", "cpu", "--db", url]) == 2
    assert "no tuning database" in capsys.readouterr().err
    monkeypatch.setenv("KREG_TUNING_DB", url)
    assert sweep_main(["--device", "cpu", "--stale", "--db", url]) == 0
    assert _choice(37).source == "default"
    store = TuningStore(url)
    assert store.tuned() == [] and store.trials() == [] and store.devices() == [] and not store.exists()
    assert not (tmp_path / "tpyo").exists()
    # A database file without the store's tables (an empty file) is read as empty and left as it was.
    empty = tmp_path / "empty.db"
    empty.touch()
    assert TuningStore(f"sqlite:///{empty}").tuned() == [] and empty.stat().st_size == 0


def test_tuning_on_first_use_with_an_unusable_store_warns_and_runs_the_default(monkeypatch):
    """KREG_AUTOTUNE=1 writes its result to the user store; a store that cannot be written must not
    make the call fail: one warning, then the variant's default."""
    from kreg.core.device import preset
    from kreg.tuning import autotune
    from kreg.tuning_db.errors import TuningDatabaseError

    def unwritable(*args, **kwargs):
        raise TuningDatabaseError("sqlite:////read-only/tuning.db: attempt to write a readonly database")

    monkeypatch.setenv("KREG_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "autotune_call", unwritable)
    op = OPS["decode"]
    shape = {**op.presets["tiny"][0], "n": 999}  # a key no table holds
    args = op.validate(**op.make_inputs(shape, device="meta", dtype=torch.bfloat16, seed=0))
    dispatch._warned.clear()
    with pytest.warns(RuntimeWarning, match="writable tuning database"):
        choice = dispatch.resolve(op, "nvidia", None, op.tuning_key(args), preset("h200"), args)
    assert choice.source == "default"


# ============================================================ 5. only regular files are read
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_no_tool_reads_a_fifo(tmp_path):
    """A FIFO where a table, a benchmark CSV or the database file belongs: one line and exit 2 at once.
    Opening one to read waits for a writer that never comes, so each tool runs in a child with a
    deadline."""
    import subprocess
    import sys

    fifo = tmp_path / "cpu__flash_attention.json"
    os.mkfifo(fifo)
    db = f"sqlite:///{tmp_path / 't.db'}"
    commands = {
        "tuning.load": ["kreg.tuning.load", str(fifo), "--db", db],
        "benchmarks.report": ["kreg.benchmarks.report", str(fifo)],
        "tuning.export": ["kreg.tuning.export", "--device", "cpu", "--db", f"sqlite:///{fifo}"],
        "tuning.sweep --stale": ["kreg.tuning.sweep", "--device", "cpu", "--stale", "--db", f"sqlite:///{fifo}"],
    }
    root = Path(__file__).resolve().parents[1]
    for name, argv in commands.items():
        done = subprocess.run([sys.executable, "-m", *argv], cwd=root, capture_output=True, text=True, timeout=120)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "FIFO" in done.stderr and len(err) == 1, (name, done.stderr[-2000:])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_among_the_shipped_tables_warns_and_the_rest_answers(tmp_path, monkeypatch):
    """The tables folder is read on the first lookup: a FIFO there must not hang it (a thread with a
    deadline stands in for the call)."""
    import threading

    folder = tmp_path / "tables"
    folder.mkdir()
    good = _tuned(_key(37), 16, 32, device=HERE)
    _table(folder / f"{HERE.key}__flash_attention.json", [good], HERE)
    os.mkfifo(folder / f"{HERE.key}__jammed.json")
    monkeypatch.setattr(table_files, "SHIPPED_TABLES", folder)
    found = {}

    def look_up():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found["choice"] = _choice(37)
        found["warnings"] = _kreg_warnings(caught)

    worker = threading.Thread(target=look_up, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the lookup blocked on the FIFO"
    assert (found["choice"].source, found["choice"].config["fwd"]) == ("tables", good.config["fwd"])
    assert len(found["warnings"]) == 1 and "FIFO" in found["warnings"][0]
