# Two entry points that work on a fresh machine (Python >= 3.11 on PATH):
#   make demo   set up .venv and train the digits job locally: 2 PS and 2 worker processes
#   make test   set up .venv, build (or reuse) the e2e control plane and the images (podman,
#               as root: e2e/image.sh), run ruff and every test
PYTHON ?= python3
# pip and pytest run as `python -m` from the repository root, as a user types them: the
# operator/ folder (a namespace package) must not shadow the standard library there.
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev,examples]'
	touch $(STAMP)

.PHONY: setup demo test bench
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowmill run examples/digits.yaml --local

test: $(STAMP)
	$(VENV)/bin/ruff check .
	FLOWMILL_PYTHON=$(VENV)/bin/python e2e/build.sh
	e2e/image.sh
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[bench]'
	$(VENV)/bin/python bench/dispatch.py
	$(VENV)/bin/python bench/mlp_step.py
	$(VENV)/bin/python bench/checkpoint.py
	$(VENV)/bin/python bench/transport.py
	$(VENV)/bin/python bench/ps_null_step.py
	$(VENV)/bin/python bench/distributed_step.py
	$(VENV)/bin/python bench/lm_step.py
	$(VENV)/bin/python bench/conv_step.py
	$(VENV)/bin/python bench/backup_workers.py
	$(VENV)/bin/python bench/input_pipeline.py
	FLOWMILL_PYTHON=$(VENV)/bin/python e2e/build.sh && $(VENV)/bin/python bench/operator.py
	$(VENV)/bin/python bench/scheduling.py
