# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-dflash-installed

.PHONY: install demo test test-fast matrix matrix-full lint format doctor clean

install: $(STAMP)

$(STAMP): ci/install.sh ci/requirements-cpu-vllm0.20.1.txt pyproject.toml setup.py \
		vllm_dflash_startup.pth vllm_dflash_startup.py $(shell find vllm_dflash -name '*.py')
	VENV=$(VENV) bash ci/install.sh
	touch $@

demo: install  ## DFlash on vLLM's CPU backend: tiny models, vllm serve, requests
	$(PY) -m vllm_dflash.testing.demo

# Two pytest workers, one test file each at a time: a single worker leaves about a
# third of the 2-core CI machine idle (engine start-ups, servers waiting on their
# engines). WORKERS=0 runs the suite in one process.
WORKERS ?= 2
test: install  ## the whole suite (unit + CPU end-to-end), as CI runs it
	$(PY) -m pytest tests -n $(WORKERS) --dist loadfile --durations=40

matrix: install  ## smoke test every other pinned vLLM (ci/matrix.toml): doctor states, lossless, diffs
	$(PY) ci/matrix.py --mode smoke

matrix-full: install  ## the whole suite on every other pinned vLLM
	$(PY) ci/matrix.py --mode full --jobs 1

test-fast: install  ## unit tests only
	$(PY) -m pytest tests -m "not cpu_e2e"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

doctor: install
	$(VENV)/bin/vllm-dflash doctor

clean:
	rm -rf $(VENV) .venv-matrix .pytest_cache
