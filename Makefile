# Two commands on a fresh machine: `make sweep` (the main job) and `make test`. Each creates .venv
# when it is missing. On a GPU machine without network (PyTorch, Triton, rich and pytest preinstalled)
# the venv reuses the system packages and installs pydantic/SQLAlchemy from wheels carried in .whl/
# (scripts/fetch_wheels.sh downloads them on a machine with network).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A GPU machine is one whose system Python already has a CUDA or ROCm PyTorch.
HAS_GPU := $(shell $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 && echo 1)

.PHONY: test sweep bench lint clean

$(VENV)/.installed: pyproject.toml scripts/make_venv.sh
	scripts/make_venv.sh $(if $(HAS_GPU),gpu,cpu) $(PYTHON) $(VENV)
	touch $@

# Test workers (pytest-xdist), one per core; on a GPU machine they share its GPU (each test allocates
# little, and nothing is timed). Work stealing keeps every worker busy to the end: the compile checks
# are few and long.
TEST_WORKERS ?= auto

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# On a GPU a full sweep takes hours: each `make sweep` runs a slice and the next one resumes it. On a
# CPU the interpreter sweep runs one process per core.
SWEEP_ARGS ?= $(if $(HAS_GPU),--max-minutes 30 --resume,--gpus $(shell nproc))

sweep: $(VENV)/.installed
	$(PY) -m kreg.tuning.sweep --device auto $(SWEEP_ARGS)
ifneq ($(HAS_GPU),1)
	# No GPU here: also compile for the MI355X (gfx950), in parallel over the cores, each role's default and
	# 4 seeded others per tiny-preset key (--full-space: all ~17,000), and print their resources.
	$(PY) -m kreg.tuning.sweep --device mi355x --compile-only
endif

bench: $(VENV)/.installed
	$(PY) -m kreg.benchmarks.run

lint: $(VENV)/.installed
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV)
