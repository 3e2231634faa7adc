"""Packaging: kreg's wheel holds the package `kreg` and nothing else, so it installs beside Hugging Face's
`kernels` (an import name the repository's kernels/ folder would otherwise take); and in a checkout the
folders' bare names (`import registry`, `python -m tuning.sweep`) are the same modules as their `kreg.`
names."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = "tuning_db/tables"
# Hugging Face's public API, as `kernels/__init__.py` exports it.
HF_KERNELS_API = ("get_kernel", "kernelize", "LayerRepository")


def _run(command: list[str], cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(command)} exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _index_unreachable() -> str | None:
    """Why the package index pip uses cannot be reached (no name, no route, refused, timed out), or None
    when it answers. Any answer counts, an HTTP or TLS error included: pip then says what is wrong."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/kernels/"
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return None if isinstance(reason, ssl.SSLError) else f"{url}: {reason}"
    return None


def _not_sources(folder: str, names: list[str]) -> set[str]:
    # What a clean clone lacks: hidden folders (.git, .venv, caches), build outputs (setuptools would put
    # an old build/lib's files into the wheel), databases, and the running interpreter's venv.
    here = Path(folder)
    return {name for name in names
            if name.startswith(".") or name in ("build", "dist", "__pycache__") or name.endswith((".egg-info", ".db"))
            or here / name == Path(sys.prefix)}


@pytest.fixture(scope="module")
def offline() -> str | None:
    return _index_unreachable()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, offline) -> Path:
    """kreg's wheel, built by pip from a copy of the repository's sources (nothing is written into it)."""
    work = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, work / "source", ignore=_not_sources)
    # Offline, setuptools comes from this environment, as scripts/make_venv.sh installs kreg on a GPU machine.
    isolation = ["--no-build-isolation"] if offline else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", *isolation,
          "-w", str(work / "dist"), str(work / "source")])
    (built,) = (work / "dist").glob("kreg-*.whl")
    return built


def _expected_files() -> set[str]:
    """Every module of the repository's packages and every shipped table, as the wheel names them."""
    out = set()
    for top in sorted(ROOT.iterdir()):
        if top.name == "tests" or not (top / "__init__.py").is_file():
            continue
        for path in top.rglob("*.py"):
            if "__pycache__" not in path.parts:
                out.add(path.relative_to(ROOT).as_posix())
    out |= {path.relative_to(ROOT).as_posix() for path in (ROOT / TABLES).glob("*.json")}
    return {name if name.startswith("kreg/") else f"kreg/{name}" for name in out}


def test_the_wheel_holds_kreg_only_with_every_module_and_table(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    dist_info = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("kreg-"), dist_info
    outside = sorted(name for name in names if name.split("/")[0] not in {"kreg", *dist_info})
    assert not outside, f"the wheel claims import names other than kreg: {outside[:10]}"
    for folder in ("kernels", "registry", "tuning", "tuning_db"):
        assert f"kreg/{folder}/__init__.py" in names
    assert any(name.startswith(f"kreg/{TABLES}/") for name in names), "the shipped tables are missing"
    missing = sorted(_expected_files() - names)
    assert not missing, f"the wheel lacks {missing[:10]}"


def _site_dirs(cwd: Path) -> list[str]:
    """The folders `site` puts on this interpreter's sys.path: its site-packages and the folders their
    .pth files name (a GPU machine's system packages), but no repository folder outside its venv."""
    probe = "import json, sys; print(json.dumps(sys.path))"
    with_site = json.loads(_run([sys.executable, "-c", probe], cwd=cwd).stdout)
    without_site = json.loads(_run([sys.executable, "-S", "-c", probe], cwd=cwd).stdout)
    venv = Path(sys.prefix).resolve()
    return [path for path in with_site if path and path not in without_site
            and (not Path(path).resolve().is_relative_to(ROOT) or Path(path).resolve().is_relative_to(venv))]


_SNIPPET = f"""
import json, sys
import kernels
import kreg
from kreg import registry
print(json.dumps({{
    "prefix": sys.prefix,
    "kernels": kernels.__file__,
    "kernels_api": [name for name in {HF_KERNELS_API!r} if callable(getattr(kernels, name, None))],
    "kreg": kreg.__file__,
    "ops": registry.ops(),
    "editable": sorted(name for name in sys.modules if name.startswith("__editable__")),
}}))
"""


def test_the_wheel_installs_beside_hugging_faces_kernels(wheel, offline, tmp_path):
    if offline:
        pytest.skip(f"the package index is unreachable, so Hugging Face's kernels cannot be installed: {offline}")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "kernels"])
    _run([*pip, "--no-deps", str(wheel)])
    # kreg's dependencies come from this environment, without this environment's own kreg: a folder named
    # on a .pth line joins sys.path but its own .pth files (an editable kreg's finder) are not read. Written
    # after the installs, so pip never sees (or touches) this environment's packages.
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "kreg-test-dependencies.pth").write_text("\n".join(_site_dirs(tmp_path)) + "\n")

    # Isolated (-I) and outside the repository: neither the working directory nor PYTHONPATH is on sys.path.
    done = _run([str(python), "-I", "-c", _SNIPPET], cwd=tmp_path)
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    inside = venv.resolve()
    assert Path(facts["prefix"]).resolve() == inside
    assert Path(facts["kernels"]).resolve().is_relative_to(inside), facts["kernels"]
    assert facts["kernels_api"] == list(HF_KERNELS_API), "`import kernels` is not Hugging Face's package"
    assert Path(facts["kreg"]).resolve().is_relative_to(inside), facts["kreg"]
    assert facts["ops"], "registry.ops() is empty"
    assert facts["editable"] == [], "this environment's editable kreg was loaded into the fresh venv"


_ALIASES = """
import json
import registry, registry.dispatch, kreg.registry.dispatch, tuning.sweep, kreg.tuning.sweep
import kreg
print(json.dumps({
    "registry": registry is kreg.registry,
    "registry.dispatch": registry.dispatch is kreg.registry.dispatch,
    "tuning": tuning is kreg.tuning,
    "tuning.sweep": tuning.sweep is kreg.tuning.sweep,
}))
"""


def test_a_checkout_answers_to_bare_names_with_the_same_modules():
    runs = {name: subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, command in (("aliases", [sys.executable, "-c", _ALIASES]),
                                  ("tuning.sweep", [sys.executable, "-m", "tuning.sweep", "--help"]),
                                  ("kreg.tuning.sweep", [sys.executable, "-m", "kreg.tuning.sweep", "--help"]))}
    out = {}
    for name, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name} exited {process.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        out[name] = stdout
    assert json.loads(out["aliases"].strip().splitlines()[-1]) == dict.fromkeys(
        ("registry", "registry.dispatch", "tuning", "tuning.sweep"), True)
    for name in ("tuning.sweep", "kreg.tuning.sweep"):
        assert out[name].startswith("usage:"), out[name][:500]


def test_a_checkout_leaves_a_bare_name_to_the_package_installed_under_it(tmp_path):
    """With another package installed as `kernels` (Hugging Face's, which transformers imports), `import
    kernels` in a checkout gives that package, its submodules too, while `kreg.kernels` and the other
    bare names stay kreg's."""
    other = tmp_path / "kernels"
    (other / "layer").mkdir(parents=True)
    (other / "__init__.py").write_text("OWNER = 'other'\nfrom kernels.layer import LAYER\n")
    (other / "layer" / "__init__.py").write_text("LAYER = 'other layer'\n")
    probe = ("import json, kernels, kernels.layer, kreg.kernels, registry, kreg.registry; print(json.dumps(["
             "kernels.OWNER, kernels.LAYER, kernels.layer.LAYER, kreg.kernels.__file__, registry is kreg.registry]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    owner, layer, submodule, ours, same = json.loads(out.stdout.strip().splitlines()[-1])
    assert (owner, layer, submodule, same) == ("other", "other layer", "other layer", True)
    assert Path(ours).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
