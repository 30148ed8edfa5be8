# tfoverlap: every set-up step is here, idempotent (stamp files in .venv/).
#   make demo   the main job
#   make test   all tests
#   make test-fast  the unit tier (not the tests marked slow)
PYTHON     ?= python3.11
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
TF_PACKAGE ?= tensorflow-cpu==2.15.1
PYTEST_ARGS ?=

include third_party/horovod.env
export HOROVOD_WITH_TENSORFLOW HOROVOD_WITH_GLOO HOROVOD_WITH_MPI HOROVOD_WITHOUT_PYTORCH HOROVOD_WITHOUT_MXNET

STAMP_SYSTEM  := $(VENV)/.stamp-system
STAMP_PYTHON  := $(VENV)/.stamp-python
STAMP_HOROVOD := $(VENV)/.stamp-horovod
STAMP_PACKAGE := $(VENV)/.stamp-tfoverlap
PACKAGE_SOURCES := setup.py pyproject.toml $(wildcard native/*.cc) $(wildcard tfoverlap/*.py tfoverlap/*/*.py)

.PHONY: all setup demo test test-fast clean distclean
all: setup
setup: $(STAMP_PACKAGE)

# Debian packages (Open MPI for Horovod, iproute2 for the testbed), only what is missing.
$(STAMP_SYSTEM):
	@mkdir -p $(VENV)
	@missing=""; for p in $$(grep -v '^#' third_party/apt-packages.txt); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@touch $@

$(STAMP_PYTHON): $(STAMP_SYSTEM) third_party/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip<25" "setuptools<70" wheel
	$(PIP) install -q "$(TF_PACKAGE)" -r third_party/requirements.txt
	@touch $@

# Horovod from source against the TensorFlow just installed (5-6 minutes on 2 cores).
$(STAMP_HOROVOD): $(STAMP_PYTHON) third_party/horovod.env
	@if $(PY) -c "import horovod, horovod.tensorflow as h; assert horovod.__version__ == '$(HOROVOD_VERSION)'; assert h.gloo_built() and h.mpi_built()" 2>/dev/null; then \
	  echo "horovod $(HOROVOD_VERSION) already built"; \
	else \
	  echo "building horovod $(HOROVOD_VERSION) with TensorFlow, Gloo and MPI (takes minutes)"; \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PIP) install -q --no-cache-dir --no-build-isolation "horovod==$(HOROVOD_VERSION)"; \
	fi
	@touch $@

# tfoverlap itself, with its Grappler plugin built against the installed TensorFlow.
$(STAMP_PACKAGE): $(STAMP_HOROVOD) $(PACKAGE_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

# Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE), every Python
# process a test starts (ranks, PS tasks, the CLI) would compile tfoverlap anew, about
# 0.2 s each: compile it once.
BYTECODE := PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q tfoverlap tests >/dev/null

test: setup
	$(BYTECODE)
	$(PY) -m pytest -ra $(PYTEST_ARGS) tests

# The unit tier (no Horovod jobs, clusters or benchmark runs: tests marked slow are left out),
# on two workers: its tests are single processes (72 s on 2 cores, 138 s on one).
test-fast: setup
	$(BYTECODE)
	$(PY) -m pytest -m "not slow" -n 2 $(PYTEST_ARGS) tests

demo: setup
	$(PY) -m tfoverlap.bench.demo

clean:
	rm -rf build *.egg-info tfoverlap/*.so .pytest_cache
distclean: clean
	rm -rf $(VENV)
