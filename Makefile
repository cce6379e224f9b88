# `make run` and `make test` work on a fresh machine with Python 3.11, pip and make:
# each first builds .venv from constraints.txt (the exact, known-good versions).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
TRL_VENV := .venv-trl
TUNIX_VENV := .venv-tunix

.PHONY: install run test lint bench bench-trl bench-tunix lock clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --constraint constraints.txt pip
	$(BIN)/pip install --quiet --constraint constraints.txt --editable ".[test,notebooks]"
	touch $@

run: $(INSTALLED)
	$(BIN)/jaxrl-llm train --config default --run-dir runs/default $(RUN_FLAGS)

# Lint and format check (ruff, configured in pyproject.toml), then the suite.
test: $(INSTALLED) lint
	$(BIN)/python -m pytest -n 2 -q

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Every benchmark's table, then the side-by-side run against TRL and Tunix (each in its own
# venv below), which writes benchmarks/results/side_by_side.{md,json} and scaling.png.
bench: $(INSTALLED) $(TRL_VENV)/.installed $(TUNIX_VENV)/.installed
	$(BIN)/python benchmarks/core_ops.py
	$(BIN)/python benchmarks/sampler.py
	$(BIN)/python benchmarks/grpo_step.py
	$(BIN)/python benchmarks/loss_memory.py
	$(BIN)/python benchmarks/state_memory.py
	$(BIN)/python benchmarks/layer_scan.py
	$(BIN)/python benchmarks/compile_depth.py
	$(BIN)/python benchmarks/side_by_side.py --scaling $(BENCH_FLAGS)

# The same GRPO step in a peer library, each in its own venv (.venv-<peer>, from
# benchmarks/<peer>/requirements.txt): .venv is untouched.
.venv-%/.installed: benchmarks/%/requirements.txt
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/pip install --quiet --requirement $<
	touch $@

# TRL's GRPOTrainer (PyTorch, CPU).
bench-trl: $(TRL_VENV)/.installed
	$(TRL_VENV)/bin/python benchmarks/trl_grpo_step.py

# Tunix's GRPOLearner (JAX, CPU).
bench-tunix: $(TUNIX_VENV)/.installed
	$(TUNIX_VENV)/bin/python benchmarks/tunix_grpo_step.py

# Re-pin constraints.txt to what is installed now (after changing pyproject.toml ranges).
lock: $(INSTALLED)
	$(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' > constraints.txt

clean:
	rm -rf $(VENV) $(TRL_VENV) $(TUNIX_VENV) .pytest_cache .hypothesis
