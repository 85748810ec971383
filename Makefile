# nbbatch — the two commands of the README are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NBBATCH := $(BIN)/nbbatch
EXPERIMENT ?= experiments/digits.yaml

.PHONY: setup envs submit demo report test test-fast lint data images bench azure-smoke clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python  ## the driver venv with nbbatch and every extra
	$(BIN)/pip install --disable-pip-version-check -q -e '.[all,test]'

envs: setup  ## one venv + Jupyter kernel per framework (rebuilt only when pins change)
	$(NBBATCH) envs create --all --parallel 2

submit: envs  ## the default experiment: runs locally, writes ./results/<experiment>/
	$(NBBATCH) submit $(EXPERIMENT)

demo: envs  ## the nine framework notebooks on digits, in parallel, then the comparison
	$(NBBATCH) submit experiments/digits.yaml
	$(NBBATCH) compare digits --report results/digits/report.html

test: envs  ## the whole test suite (framework envs are built once above)
	$(BIN)/python -m pytest -q

test-fast: setup  ## tests that need no framework env, no browser and no cluster
	$(BIN)/python -m pytest -q -m "not slow and not browser and not ray"

lint: setup
	$(BIN)/ruff check src tests benchmarks

data: setup  ## download real CIFAR-10 (python pickle batches) into ./data, checksum checked
	$(BIN)/python -m nbbatch.data data

bench: envs  ## benchmarks/*.py, numbers go to docs/benchmarks.md
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf results .pytest_cache test-artifacts
