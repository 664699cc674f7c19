# tierkv: the two commands a new user needs.
#   make demo   - set up .venv, build a tiny local model, serve it with vLLM + TierKVConnector, run a client
#   make test   - set up .venv and run the test suite
# Everything is installed from nothing on a new machine; the second run is quick (a stamp file).

PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.tierkv-installed
PYTEST_ARGS ?=

.PHONY: demo test venv bench clean-venv sysdeps

$(STAMP): setup.py Makefile .ci/setup_env.sh
	bash .ci/setup_env.sh $(PY) $(VENV)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) benchmarks/e2e_cpu.py

clean-venv:
	rm -rf $(VENV)
