"""Packaging: the repository's top-level folders install as subpackages of `kreg` (registry/ becomes
kreg.registry, kernels/nvidia/ kreg.kernels.nvidia), so an installed kreg claims no import name but
its own. Metadata and dependencies are in pyproject.toml; this only maps the folders."""

from setuptools import find_packages, setup

layers = find_packages(exclude=["kreg", "kreg.*", "tests", "tests.*"])
setup(
    packages=["kreg", *(f"kreg.{package}" for package in layers)],
    package_dir={"kreg": "kreg", **{f"kreg.{package}": package.replace(".", "/") for package in layers}},
    package_data={"kreg.tuning_db": ["tables/*.json"]},
)
