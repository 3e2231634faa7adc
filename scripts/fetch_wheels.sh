#!/usr/bin/env bash
# Download the wheels a GPU machine without network lacks (pydantic, SQLAlchemy and their needs, and
# numpy<2.4, which the Triton 3.6 interpreter needs where the image has a newer one) into
# .whl/ (git-ignored); carry that folder to the GPU machine, where `make` installs them offline.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 sqlalchemy==2.1.9 numpy==2.3.5
ls .whl
