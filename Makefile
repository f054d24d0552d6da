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
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/splitserve up

# ruff (pyproject.toml [tool.ruff]) and buf's STANDARD lint on the pd.v1 protos (protos/buf.yaml)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/buf lint protos

# the whole suite in file order, then the fast tests again in random order (pytest-randomly; the seed is printed:
# pytest -m "not slow" -p randomly --randomly-seed=N repeats that order). The slow cluster tests share module-scoped
# clusters that some of them stop or restart; in random order they break each other (issue 15 notes), so they run in
# file order until each destructive test has a cluster of its own.
test: lint
	$(PY) -m pytest -q -p no:randomly --durations=25
	seed=$$(od -An -N2 -tu2 /dev/urandom | tr -d ' '); echo "random order: --randomly-seed=$$seed"; \
	$(PY) -m pytest -q -m "not slow" -p randomly --randomly-seed=$$seed

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
