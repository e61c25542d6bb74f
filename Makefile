# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
#
# TORCH_SPEC chooses the PyTorch build. The default is the CPU build (pinned: a bare
# `torch` would pull a multi-GB CUDA build). Examples:
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"   # GPU workstation
#   make test TORCH_SPEC="/path/to/torch-2.5.0a0+nv24.08-cp310-cp310-linux_aarch64.whl"      # Jetson (JetPack wheel)
PYTHON      ?= python3.11
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# The tested versions of every other package (constraints.txt); CONSTRAINTS= installs the newest pyproject allows.
CONSTRAINTS ?= constraints.txt
# pytest-xdist workers for make test: 2 where the machine has 2 cores or more (the suite waits on sessions,
# browsers and subprocesses much of the time), else 0 (one process). TEST_WORKERS=0 runs it in one process.
# tests/conftest.py decides what runs where: a test file per unit, the files that start Ray in one unit; the
# files marked timing run afterwards in one process of their own.
TEST_WORKERS ?= $(shell [ "$$(nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 0)
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed

.PHONY: venv demo test bench lint clean constraints

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile $(CONSTRAINTS)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[train,sim,rl,monitor,lsl,scale,dev]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m closedloop.sdk.demo

test: $(STAMP)
	@tools/ensure_chromium.sh
	@# the Numba plan runner once, before the tests (a fresh checkout compiles it: about a minute on 2 cores)
	$(PY) -m closedloop.sdk.package.warm
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest -q
else
	@# the files marked timing assert wall-clock bounds: they run in one process, alone, after the rest
	@$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not timing"; parallel=$$?; \
	echo "$(PY) -m pytest -q -m timing"; $(PY) -m pytest -q -m timing; alone=$$?; \
	exit $$(( parallel != 0 ? parallel : alone ))
endif

bench: $(STAMP)
	$(PY) bench/bench_spine.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/typecheck.py

# after a green `make test` on newer packages (CONSTRAINTS=): record them as the tested set
constraints: $(STAMP)
	@{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt && echo "constraints.txt: $$(grep -vc '^#' constraints.txt) packages"

clean:
	rm -rf $(VENV) build *.egg-info
