# nanoserve: every target bootstraps its own virtualenv (.venv) on first use, with only what
# it needs: serve = scheduler + worker, test adds dev, demo adds demo. Which torch the venv
# gets (the host's CUDA torch, PyPI's CUDA build, or the CPU build) is
# worker_service/host_torch.py's choice: `make torch-choice` says which and why.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PINS   := $(VENV)/constraints.txt
PROTOS := $(wildcard protos/nanoserve/v1/*.proto)
STUBS  := $(PROTOS:.proto=_pb2.py)
MODEL  ?=
TP     ?= 1
HTTP_PORT ?=
KV_DTYPE ?=
QUANTIZATION ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS_serve := worker,proto
EXTRAS_test  := worker,proto,dev
EXTRAS_demo  := worker,proto,demo

.PHONY: help setup proto test test-gpu demo serve flash-attn clean torch-choice compose-check

help:
	@echo "make demo                 serve an embedded default model on loopback and stream a generation"
	@echo "make test                 run the CPU test suite (what CI runs)"
	@echo "make serve MODEL=dir      serve a Hugging Face Qwen3 directory (GPU host), TP=N for N ranks,"
	@echo "                          HTTP_PORT=8000 to add the OpenAI-compatible HTTP API,"
	@echo "                          KV_DTYPE=fp8 for an fp8 KV cache (~2x the blocks)"
	@echo "                          QUANTIZATION=fp8 for FP8 weights (linear layers)"
	@echo "                          ADAPTER_ROOT=/dir to allow loading LoRA adapters from there at run time"
	@echo "make proto                regenerate the gRPC stubs from protos/"
	@echo "make compose-check        build the images, run the CPU compose stack for real (root; starts dockerd)"
	@echo "make flash-attn           build + install a trimmed flash-attn wheel (GPU host with nvcc, ~6-13 min)"

setup: $(VENV)/.installed-test

torch-choice:
	@$(PYTHON) worker_service/host_torch.py --python $(PYTHON) --print-choice

# The venv and its torch; $(PINS) holds the torch/triton pins later installs keep.
$(PINS): constraints.txt worker_service/host_torch.py
	$(PYTHON) worker_service/host_torch.py --venv $(VENV) --python $(PYTHON) \
		--constraints constraints.txt --cpu-index '$(TORCH_CPU_INDEX)'

$(VENV)/.installed-%: $(PINS) pyproject.toml
	$(BIN)/python -m pip install -q -c $(PINS) -e '.[$(EXTRAS_$*)]'
	touch $@

proto: $(STUBS)

$(STUBS) &: $(PROTOS) | $(PINS)
	$(BIN)/python -c "import grpc_tools" 2>/dev/null || $(MAKE) $(VENV)/.installed-serve
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTOS)

# Two pytest workers (pytest-xdist), each taking whole files: the suite is mostly the Triton
# interpreter and service processes, which two workers overlap on two cores. Files marked
# `alone` (kill schedules, fair shares, memory and timing measures) then run in one process,
# where no other test's processes slow theirs. TEST_WORKERS=0: all in one process.
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10
test: $(VENV)/.installed-test proto
ifeq ($(TEST_WORKERS),0)
	$(PYTEST) tests
else
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not alone" tests; r=$$?; \
		$(PYTEST) -m alone tests || exit 1; exit $$r
endif

# Build the images and run docker-compose.yml + docker-compose.cpu.yml for real (tests/compose_check.py):
# starts dockerd if none answers (../shared/CONTAINERS.md), streams through the published ports,
# kills a worker mid-stream, compose down; prints image sizes and build / start times.
compose-check: $(VENV)/.installed-test proto
	$(BIN)/python tests/compose_check.py

# Serve the embedded default model (or MODEL=dir) on loopback and stream one answer.
demo: $(VENV)/.installed-demo proto
	$(BIN)/python -m client.demo $(if $(MODEL),--model $(MODEL),)

# Scheduler on :50051 + TP worker processes on this host (GPU when present). Ctrl-C stops all.
# HTTP_PORT=8000 also serves the OpenAI-compatible HTTP API on that port; ADAPTER_ROOT=/dir lets
# callers load LoRA adapters from that directory at run time (off when unset); SCHED_ARGS adds
# scheduler flags (python -m scheduler_service --help), e.g. SCHED_ARGS="--max-num-seqs 128".
serve: $(VENV)/.installed-serve proto
	@test -n "$(MODEL)" || (echo "usage: make serve MODEL=/path/to/hf-model [TP=2]"; exit 2)
	$(BIN)/python -m scheduler_service.launch --model $(MODEL) --tp $(TP) \
		$(if $(HTTP_PORT),--http-port $(HTTP_PORT),) $(if $(KV_DTYPE),--kv-cache-dtype $(KV_DTYPE),) $(if $(QUANTIZATION),--quantization $(QUANTIZATION),) \
		$(if $(ADAPTER_ROOT),--adapter-root $(ADAPTER_ROOT),) \
		$(if $(SCHED_ARGS),-- $(SCHED_ARGS),)

# Trimmed flash-attn 2 wheel from PyPI's sdist (only the kernels the worker calls), built
# against FA_PYTHON's torch with nvcc and installed there. FLASH_ATTN_ARGS: see
# `python kernels/build_flash_attn.py --help` (e.g. --head-dims 128 --dtypes bf16 --archs 90).
FA_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
FLASH_ATTN_ARGS ?=
flash-attn:
	$(FA_PYTHON) kernels/build_flash_attn.py --install $(FLASH_ATTN_ARGS)

clean:
	rm -rf $(VENV) $(STUBS) $(PROTOS:.proto=_pb2.pyi) $(PROTOS:.proto=_pb2_grpc.py)
