"""Resource reports of `--compile-only`: every config compiled for a target, with registers, spills,
shared memory/LDS and estimated occupancy (`tuning.occupancy`), by op, tuning key, variant and role,
a pair of files per device and op beside the tuned tables, so that machines that compiled different ops
each ship their own: `<device key>__<op>__resources.csv` with every config, and `.md` summarizing each
key, variant and role (counts, the best occupancy without spills, the default's).

Rows come from the device's compile-only runs in the store; when a config was compiled by several
runs the latest row counts, and rows of kernel sources that changed since are left out.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import NamedTuple

from kreg.core.device import DeviceInfo
from kreg.tuning.engine import NOT_LAUNCHED
from kreg.tuning.export import check_replaceable, file_name, markdown_cell, write_atomic
from kreg.tuning.occupancy import occupancy

COLUMNS = ("op", "tuning_key", "variant", "source_hash", "role", "config", "status", "registers", "spills",
           "shared_bytes", "warps_per_unit", "occupancy", "limited_by", "reason")


def report_rows(store, device: DeviceInfo, registry_variants: dict) -> list[dict]:
    """One row per (op, key, variant, role, call config) the device's compile-only runs recorded for the
    current kernel sources, ops and keys sorted."""
    hashes = {(v.vendor, v.name): v.source_hash for vs in registry_variants.values() for v in vs}
    latest: dict[tuple, object] = {}
    for op in sorted(registry_variants):
        for run_id, _, args in store.runs(op, device.key):
            if not args.get("compile_only"):
                continue
            for t in store.trials(run_id=run_id):
                if hashes.get((t.vendor, t.variant)) == t.source_hash:
                    latest[(t.op, t.tuning_key, t.variant, t.role, t.config.to_json())] = t
    rows = []
    for (op, key, variant, role, _), t in sorted(latest.items(), key=lambda item: item[0]):
        config = t.config[role]
        estimate = None
        if t.status == "ok" and t.registers is not None:
            estimate = occupancy(device, t.registers, t.shared_bytes or 0, config.num_warps)
        rows.append({"op": op, "tuning_key": key, "variant": variant, "source_hash": t.source_hash, "role": role,
                     "config": str(config), "status": t.status, "registers": t.registers, "spills": t.spills,
                     "shared_bytes": t.shared_bytes,
                     "warps_per_unit": None if estimate is None else estimate.warps,
                     "occupancy": None if estimate is None else round(estimate.fraction, 4),
                     "limited_by": None if estimate is None else estimate.limit, "reason": t.error})
    return rows


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


class _Group(NamedTuple):
    """One (op, key, variant, role) of a report: its rows, those that compiled, those of them without
    spills, the best of those by estimated occupancy, and the default dispatch runs there with its row."""

    op: str
    key: str
    variant: str
    role: str
    rows: list[dict]
    ok: list[dict]
    fit: list[dict]
    best: dict | None
    default: str
    mine: dict | None


def _groups(rows: list[dict], registry_variants: dict, device: DeviceInfo) -> list[_Group]:
    """The report's (op, key, variant, role) groups of the device vendor's registered variants, sorted."""
    variants = {v.name: v for vs in registry_variants.values() for v in vs if v.vendor == device.vendor}
    found: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["variant"] in variants:
            found.setdefault((row["op"], row["tuning_key"], row["variant"], row["role"]), []).append(row)
    out = []
    for (op, key, name, role), members in sorted(found.items()):
        ok = [r for r in members if r["status"] == "ok"]
        fit = [r for r in ok if not _number(r["spills"])]
        best = max(fit, key=lambda r: _number(r["occupancy"]) or 0.0, default=None)
        default = str(variants[name].default_config(json.loads(key), device)[role])
        mine = next((r for r in members if r["config"] == default), None)
        out.append(_Group(op, key, name, role, members, ok, fit, best, default, mine))
    return out


def to_markdown(rows: list[dict], device: DeviceInfo, registry_variants: dict) -> str:
    """A summary for reading, one line per key, variant and role (the CSV holds every config): how many
    configs compiled, spilled or were rejected, the best estimated occupancy without spills and the
    config that has it, and the default dispatch runs there when nothing is tuned, with its own."""
    unit = "warps per SM" if device.vendor == "nvidia" else "waves per CU"
    header = ("op", "tuning_key", "variant", "role", "configs", "ok", "spilling", "rejected", "best occupancy",
              "best config", "default occupancy", "default config")
    lines = [f"Compile-only resources on {device.name} ({device.key}, {device.arch}), summarized per key, variant "
             f"and role (the CSV beside this file has every config). Occupancy is {unit} as a fraction of the most "
             "it holds, estimated from registers, shared memory/LDS and warps per program; 'ok' compiled, "
             "'spilling' is the part of those that spills registers, 'rejected' was pruned or did not compile.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in _groups(rows, registry_variants, device):
        mine = "not compiled" if g.mine is None else (
            str(g.mine["occupancy"]) if g.mine in g.fit else f"{g.mine['status']}, {g.mine['spills'] or 0} B spilled")
        best = ("", "") if g.best is None else (g.best["occupancy"], g.best["config"])
        cells = (g.op, g.key, g.variant, g.role, len(g.rows), len(g.ok), len(g.ok) - len(g.fit),
                 len(g.rows) - len(g.ok), *best, mine, g.default)
        lines.append("| " + " | ".join(markdown_cell("" if c is None else str(c)) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def report_paths(out_dir: str | Path, device: DeviceInfo, op: str) -> tuple[Path, Path]:
    stem = Path(out_dir) / f"{file_name(device.key)}__{file_name(op)}__resources"
    return stem.with_suffix(".csv"), stem.with_suffix(".md")


def write_report(store, device: DeviceInfo, registry_variants: dict, out_dir: str | Path,
                 ops: list[str]) -> list[Path]:
    """Write the report of each op of `ops` that the store holds rows for as CSV and Markdown into
    `out_dir`; returns the paths. Other ops' files are left alone: this store may hold less of them
    than a file another machine wrote."""
    rows = report_rows(store, device, {op: registry_variants[op] for op in ops if op in registry_variants})
    written = []
    for op in ops:
        mine = [row for row in rows if row["op"] == op]
        if not mine:
            continue
        paths = report_paths(out_dir, device, op)
        for path in paths:
            check_replaceable(path, "--export")
        written += [write_atomic(paths[0], to_csv(mine)),
                    write_atomic(paths[1], to_markdown(mine, device, registry_variants))]
    return written


def _number(value) -> float | None:
    """A report cell as a number (rows from `report_rows` hold numbers, rows read from CSV text)."""
    return None if value in (None, "") else float(value)


def default_problems(rows: list[dict], registry_variants: dict, device: DeviceInfo) -> list[str]:
    """Where a variant's default config is not what the report supports, one line each: for every op, key,
    variant and role of the report (CSV or `report_rows` rows), the default that dispatch would run
    there (`Variant.default_config`) must have compiled without spills and have the best estimated
    occupancy of the configs that did."""
    problems = []
    for g in _groups(rows, registry_variants, device):
        if all(r["reason"] == NOT_LAUNCHED for r in g.rows):
            continue  # the role does not run at this key: no default to judge
        where = f"{g.op} {g.key} {g.variant} {g.role}"
        if g.mine is None:
            problems.append(f"{where}: the default {g.default} is not in the report")
        elif g.mine not in g.fit:
            problems.append(f"{where}: the default {g.default} is {g.mine['status']} with {g.mine['spills'] or 0} B "
                            f"of spills ({g.mine['reason'] or 'no reason recorded'})")
        elif (_number(g.best["occupancy"]) or 0.0) > (_number(g.mine["occupancy"]) or 0.0):
            problems.append(f"{where}: the default {g.default} has occupancy {g.mine['occupancy']}, "
                            f"{g.best['config']} {g.best['occupancy']} without spills")
    return problems

