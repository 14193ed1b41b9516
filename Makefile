# Set-up contract: `make serve` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct

.PHONY: install redis serve test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/python -c "import torch; from tokenmill.engine.runner.attention import load_cpu_kernel; from tokenmill.engine.models.layers.fused import select_layer_ops; from tokenmill.engine.structured_output import bitmask; load_cpu_kernel(); select_layer_ops(torch.device('cpu'), torch.float32); bitmask.load_cpu_kernel(); from tokenmill.engine.quantization import int8_activations; int8_activations.load_cpu_kernel()"
	touch $(STAMP)

# The gateway's tests run a real Redis (shared cache and rate limits): Debian's redis-server.
redis:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

serve: install
	$(BIN)/tokenmill models pull $(MODEL)
	$(BIN)/tokenmill serve $(MODEL) --host 127.0.0.1 --port 8000

test: install redis
	$(BIN)/tokenmill models pull $(MODEL)
	$(BIN)/python -m pytest -q

test-fast: install redis
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
