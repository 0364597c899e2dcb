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

# The unit and adversarial tests run in TEST_WORKERS processes (pytest-xdist, a whole file per
# worker, one torch thread each): one pytest leaves a core idle on them (measured on 2 AMD EPYC
# cores: unit 3.7 min instead of 6.5, adversarial 2.5 instead of 4.4). The end-to-end and
# multi-rank tests run in one pytest: they start their own process groups and share launches.
# Both parts always run; the target fails if either failed. `make test ARGS=...` runs one pytest.
TEST_WORKERS ?= 2
test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit tests/adversarial; first=$$?; \
	$(PY) -m pytest -q tests --ignore=tests/unit --ignore=tests/adversarial; rest=$$?; \
	test $$first -eq 0 && test $$rest -eq 0
else
	$(PY) -m pytest -q $(ARGS)
endif

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# Regenerate the README config reference from the schema (a test checks it is current).
readme-reference: $(STAMP)
	$(PY) -c "import re,pathlib; from slipstream.config.load import reference_markdown as r; p=pathlib.Path('README.md'); s=p.read_text(); p.write_text(re.sub(r'(<!-- config-reference:start -->\n).*?(<!-- config-reference:end -->)', lambda m: m.group(1)+r()+'\n'+m.group(2), s, flags=re.S))"
