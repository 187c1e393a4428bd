# nanoserve: every target bootstraps its own virtualenv (.venv) on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/nanoserve/v1/*.proto)
STUBS  := $(PROTOS:.proto=_pb2.py)
MODEL  ?=
TP     ?= 1

.PHONY: help setup proto test test-gpu demo serve clean

help:
	@echo "make demo                 serve an embedded default model on loopback and stream a generation"
	@echo "make test                 run the CPU test suite (what CI runs)"
	@echo "make serve MODEL=dir      serve a Hugging Face Qwen3 directory (GPU host), TP=N for N ranks"
	@echo "make proto                regenerate the gRPC stubs from protos/"

setup: $(STAMP)

# constraints.txt keeps torch on the local CPU wheel (no CUDA download).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[worker,dev]'
	touch $@

proto: $(STUBS)

$(STUBS) &: $(PROTOS) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTOS)

test: proto
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) $(STUBS) $(PROTOS:.proto=_pb2.pyi) $(PROTOS:.proto=_pb2_grpc.py)
