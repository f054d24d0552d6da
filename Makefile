# Two commands on a fresh machine:  `make up`  (serve the embedded model)  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up lint test test-fast bench-transfer bench-kvstore bench-tracing protos check-protos clean image

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# splitserve's CPU kernels (splitserve/kernels/cpu_kernels.cpp), built once here so no server builds them at start-up;
	# without g++ float32 models run on torch.mm and SDPA
	$(PY) -m splitserve.kernels.build || echo "CPU kernels not built: float32 models will run on torch.mm and SDPA"
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/splitserve up

# ruff (pyproject.toml [tool.ruff]) and buf's STANDARD lint on the pd.v1 protos (protos/buf.yaml)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/buf lint protos

# the whole suite once, in random order (pytest-randomly shuffles the modules, then the tests of each module); the
# seed is printed first and `make test SEED=N` repeats that order. Tests that stop, kill or reconfigure a process of
# a cluster shared by their module restore it before the next test (tests/cluster.py restore) or have one of their own.
ifndef SEED
SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
test: lint
	@echo "random order, seed $(SEED): make test SEED=$(SEED) repeats it"
	$(PY) -m pytest -q -p randomly --randomly-seed=$(SEED) --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench-transfer: install
	$(PY) benchmarks/kv_transfer.py

bench-kvstore: install
	$(PY) benchmarks/kvstore_trace.py

bench-tracing: install
	$(PY) benchmarks/tracing_overhead.py

protos: install
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info

# container image (Dockerfile; CUDA torch: make image TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
image:
	docker build --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) -t splitserve:latest .
