# nbbatch — the two commands of the README are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NBBATCH := $(BIN)/nbbatch
EXPERIMENT ?= experiments/digits.yaml
# pytest-xdist workers: kernel tests mostly wait on subprocesses, so more workers than cores pay. Each heavy fixture
# (Slurm, podman and the registry) keeps its tests in one worker (tests/conftest.py: SHARED_FIXTURE_GROUPS).
TEST_WORKERS ?= 4
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

.PHONY: setup envs submit demo demo-quick study report test test-fast test-unit lint data images bench azure-smoke clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python  ## the driver venv with nbbatch and every extra
	$(BIN)/pip install --disable-pip-version-check -q --upgrade pip
	$(BIN)/pip install --disable-pip-version-check -q -e '.[all,test]'

envs: setup  ## one venv + Jupyter kernel per framework (rebuilt only when pins change)
	$(NBBATCH) envs create --all --parallel 2

submit: envs  ## the default experiment: runs locally, writes ./results/<experiment>/
	$(NBBATCH) submit $(EXPERIMENT)

demo: envs  ## the nine framework notebooks on digits, in parallel, then the comparison
	$(NBBATCH) submit experiments/digits.yaml
	$(NBBATCH) compare digits --report results/digits/report.html

demo-quick: setup  ## a quick look: one framework (PyTorch) on digits, its env only, then its report
	$(NBBATCH) envs create pytorch
	$(NBBATCH) submit experiments/digits-quick.yaml
	$(NBBATCH) compare digits-quick --report results/digits-quick/report.html

study: envs  ## the bundled pipeline: prepare digits → sweep two frameworks → train the best again, with its report
	$(NBBATCH) submit experiments/digits-study.yaml
	$(NBBATCH) compare digits-study --report results/digits-study/report.html

test: envs  ## the whole test suite (framework envs are built once above)
	$(PYTEST)

test-fast: setup  ## tests that need no framework env, no browser and no cluster
	$(PYTEST) -m "not slow and not browser and not ray and not container and not slurm"

test-unit: setup  ## the unit tier: test-fast without the tests that start Jupyter kernels; passes on `pip install -e '.[test]'` alone
	$(PYTEST) -m "not kernel and not slow and not browser and not ray and not container and not slurm"

lint: setup
	$(BIN)/ruff check src tests benchmarks

data: setup  ## download real CIFAR-10 (python pickle batches) into ./data, checksum checked
	$(BIN)/python -m nbbatch.data data

bench: setup  ## the CPU benchmarks (benchmarks/*.py; GPU ones: see docs/benchmarks.md), numbers go to docs/benchmarks.md
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/many_cells.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/makespan.py --simulate

images: setup  ## one GPU image per framework from dockerfiles/Dockerfile, with Docker or Podman (docs/containers.md)
	$(NBBATCH) images build --all

clean:
	rm -rf results .pytest_cache test-artifacts

AZURE_VM ?= Standard_NC4as_T4_v3
AZURE_SMOKE := .nbbatch/azure-smoke.yaml

azure-smoke: setup  ## one tiny GPU run, then the live probes held to thresholds, on a real Azure ML workspace (billed; docs/azure.md); fails when any probe does
	@$(BIN)/python benchmarks/azure_smoke.py --cost-only --vm-size $(AZURE_VM)
	@for v in AZURE_SUBSCRIPTION_ID AZURE_RESOURCE_GROUP AZUREML_WORKSPACE NBBATCH_AZURE_SHARE; do \
	  if [ -z "$$(printenv $$v)" ]; then echo "azure-smoke: set $$v (see docs/azure.md)"; exit 2; fi; done
	@mkdir -p .nbbatch
	@printf '%s\n' '# written by make azure-smoke' 'experiment: azure-smoke' 'frameworks: [pytorch]' \
	  'parameters: {DATASET: digits, EPOCHS: 1, GPU: true}' 'resources: {gpus: 1}' 'timeout: {run: 2700}' \
	  'backend: {name: azureml, compute: nbbatch-smoke, vm_size: $(AZURE_VM), max_nodes: 1, idle_time_before_scale_down: 300}' \
	  "share: $$NBBATCH_AZURE_SHARE" > $(AZURE_SMOKE)
	$(NBBATCH) submit $(AZURE_SMOKE) --force; status=$$?; \
	  $(NBBATCH) fetch azure-smoke results --share "$$NBBATCH_AZURE_SHARE"; \
	  $(NBBATCH) cluster delete --experiment $(AZURE_SMOKE); \
	  $(BIN)/python benchmarks/azure_smoke.py --vm-size $(AZURE_VM) --folder .nbbatch/azure-smoke; probes=$$?; \
	  for e in azure-probe azure-probe-2node; do $(NBBATCH) cluster delete --experiment .nbbatch/azure-smoke/$$e.yaml; done; \
	  [ $$status = 0 ] && exit $$probes; exit $$status
