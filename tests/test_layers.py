"""The import structure docs/architecture.md promises: each folder imports only the folders its row of
the layer table names, and no modules import each other in a loop. Imports inside functions count."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "kreg"
# The namespace package itself (its checkout glue) is below every layer.
GLUE = {NAMESPACE, f"{NAMESPACE}._checkout"}


def _layer_table() -> dict[str, set[str]]:
    """folder -> what it may import (folders, or dotted modules such as tuning.autotune)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| \d+ \| `(\w+)/` \|.*\| ([^|]*) \|$", text, re.M)
    assert rows, "docs/architecture.md has no layer table"
    return {folder: set(re.findall(r"`([\w.]+)`", imports)) for folder, imports in rows}


def _modules() -> dict[str, Path]:
    """Every module of the package by its kreg name."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "scripts", ".venv", "build") or not (ROOT / rel.parts[0] / "__init__.py").exists():
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts) if parts[0] == NAMESPACE else ".".join([NAMESPACE, *parts])
        out[name] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its code."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            found |= {target for name in names if name.startswith(NAMESPACE)
                      and (target := resolve(name)) is not None and target != module}
        graph[module] = found
    return graph


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return None if module in GLUE else parts[1]


def test_every_folder_has_a_row_in_the_layer_table():
    table = _layer_table()
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", NAMESPACE}
    assert folders == set(table), "a folder without a row (or a row without a folder) in docs/architecture.md"


def test_each_folder_imports_only_what_its_layer_may():
    table = _layer_table()
    modules = _modules()
    wrong = []
    for module, targets in _imports(modules).items():
        folder = _folder(module)
        if folder is None:
            continue
        for target in targets:
            other = _folder(target)
            if other is None or other == folder:
                continue
            short = target.removeprefix(f"{NAMESPACE}.")
            if not any(short == allowed or short.startswith(f"{allowed}.") for allowed in table[folder]):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports the layer table does not allow:\n" + "\n".join(sorted(wrong))


def test_no_modules_import_each_other_in_a_loop():
    graph = _imports(_modules())
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []
    loops = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                loops.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_the_checks_see_the_whole_package():
    """The checks above read something: every layer's modules and their imports of each other."""
    graph = _imports(_modules())
    assert {_folder(m) for m in graph} >= set(_layer_table())
    assert "kreg.ops.catalog" in graph["kreg.kernels.nvidia.decode"]
    assert "kreg.tuning.autotune" in graph["kreg.registry.dispatch"]


def test_kernels_take_the_device_and_key_from_their_plan():
    """Dispatch binds a variant with a CallPlan (config, key, device): no kernel module detects a device
    or computes a tuning key. The GSA layer's elementwise kernels, called directly and not through
    dispatch (docs/architecture.md, "Kernels outside the registry"), pick their tiles from the device."""
    found = []
    for path in (ROOT / "kernels").rglob("*.py"):
        if path.name == "gsa_layer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            called = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if "detect" in names or called in ("tuning_key", "get_device_capability", "get_device_properties"):
                found.append(str(path.relative_to(ROOT)))
    assert not found, found


def _host_calls(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of calls `triton.<name>` outside jitted functions (Triton's or Gluon's `jit`)."""
    lines = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            return  # device code: Triton's own constexpr functions belong here
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton"):
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return lines


def test_host_code_takes_plain_integer_math():
    """`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.6, about 3.4 us a
    call on the host (kernels/common/tiles.py): the package's host code uses tiles.cdiv/next_pow2."""
    names = {"cdiv", "next_power_of_2"}
    probe = ast.parse("@triton.jit\ndef k():\n    triton.cdiv(1, 2)\ndef host():\n    triton.cdiv(1, 2)\n")
    assert _host_calls(probe, names) == [5]  # the check tells device code from host code
    found = [f"{path.relative_to(ROOT)}:{line}" for path in _modules().values()
             for line in _host_calls(ast.parse(path.read_text()), names)]
    assert not found, found
