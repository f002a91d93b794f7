# The two set-up commands: `make serve` and `make test`. Both create .venv and install on first use.
# TORCH_SPEC picks the torch build: the default is the CPU wheel these machines keep on disk; on a CUDA
# machine install your CUDA build of torch into .venv first (or set TORCH_SPEC), and it is kept.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.coalesce-installed
PYTEST_ARGS ?=

.PHONY: install serve test test-busy lint fuzz bench soak gpu-check gpu-bundle clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/coalesce serve $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

# The suite beside BUSY busy loops (default 2: on two cores, half the CPU each test gets alone), as on a
# slower machine or one shared with other work: a test whose premise holds only on an idle machine fails
# here first, and more often than in `make test`. Not part of CI: it takes about twice as long.
BUSY ?= 2
test-busy: $(STAMP)
	@pids=; for i in $$(seq $(BUSY)); do $(PYTHON) -c 'while True: pass' & pids="$$pids $$!"; done; \
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest $(PYTEST_ARGS); rc=$$?; kill $$pids; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check service kernels loadtests tests
	$(VENV)/bin/mypy service kernels loadtests

# schemathesis against a `coalesce serve` it starts on loopback (the packaged model and tiny classifier,
# reranker and SPLADE models), every route of /openapi.json, fixed seed, 500 examples per route:
# make fuzz ARGS="--max-examples 1000", ARGS="--api-keys" (keys on), ARGS="-- --report json" (schemathesis's);
# ARGS="--bench-file BENCHMARKS.md" writes the run's figures into BENCHMARKS.md's fuzz section
fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m tests.integration.fuzz $(ARGS)

# Regenerates BENCHMARKS.md's CPU tables (run on an otherwise idle machine): make bench ARGS="--only foundation"
bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m coalesce.loadtests.bench $(ARGS)

# Ten minutes alternating half and twice the measured capacity (not in CI; run on an idle machine):
# BENCHMARKS.md's soak section. A short smoke run: make soak ARGS="--soak-minutes 1 --file /tmp/b.md"
soak: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m coalesce.loadtests.bench --only soak $(ARGS)

# The one-call GPU check (CUDA machine): correctness, latency table, capture cost, service throughput.
gpu-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m coalesce.loadtests.gpu.check --service-cmd "$(VENV)/bin/coalesce serve --port {port} --log-level warning"

# What a session lent the GPU machine carries there (it lacks msgspec, structlog, orjson, py-spy and the
# packaged model and reaches no registry): .gpu/, then `bash kernels/gpu_session.sh` there with .gpu carried.
gpu-bundle: $(STAMP)
	$(PY) -m coalesce.loadtests.gpu.bundle pack .gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
