# The two commands of the README. Each one creates .venv and installs the pinned
# dependencies on first use (torch is pinned to the CPU build: an unpinned torch
# would pull a multi-GB CUDA build), then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the CPU build of torch comes from. Our dev/CI machines have the 2.13.0 CPU wheel on
# local disk; elsewhere run e.g. `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple,)

.PHONY: train test venv clean readme-reference
venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt $(TORCH_FROM) torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/slipstream train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# Regenerate the README config reference from the schema (a test checks it is current).
readme-reference: $(STAMP)
	$(PY) -c "import re,pathlib; from slipstream.config.load import reference_markdown as r; p=pathlib.Path('README.md'); s=p.read_text(); p.write_text(re.sub(r'(<!-- config-reference:start -->\n).*?(<!-- config-reference:end -->)', lambda m: m.group(1)+r()+'\n'+m.group(2), s, flags=re.S))"
