# tierkv: the two commands a new user needs.
#   make demo   - set up .venv, build a tiny local model, serve it with vLLM + TierKVConnector, run a client
#   make test   - set up .venv and run the test suite
# Everything is installed from nothing on a new machine; the second run is quick (a stamp file).

PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.tierkv-installed
PYTEST_ARGS ?=
# test files run on this many pytest-xdist workers (a whole file per worker: module fixtures share their engines);
# on the 2-core machines the suite runs on, a lone engine test leaves a core idle half the time
TEST_WORKERS ?= 2

.PHONY: demo test venv bench clean-venv sysdeps

$(STAMP): setup.py Makefile .ci/setup_env.sh
	bash .ci/setup_env.sh $(PY) $(VENV)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) -m benchmarks.e2e_cpu

clean-venv:
	rm -rf $(VENV)
