# The two commands of the README. Each one creates .venv and installs the pinned
# dependencies on first use (torch is pinned to the CPU build: an unpinned torch
# would pull a multi-GB CUDA build), then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test venv clean
venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/slipstream train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
