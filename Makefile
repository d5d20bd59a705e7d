# Baton: `make run` (the main job) and `make test`. Everything installs itself into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BATON  := $(VENV)/bin/baton
STAMP  := $(VENV)/.installed

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	bash scripts/ensure-redis.sh || true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, so nothing later resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ucx]'
	touch $(STAMP)

run: install
	$(BATON) model tiny
	$(BATON) up

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) build *.egg-info
