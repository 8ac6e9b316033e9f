# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-slow docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $@

demo: setup
	$(PY) tutorials/demo.py

test: setup
	$(PY) -m pytest -q -m "not slow" --durations=15

test-slow: setup
	$(PY) -m pytest -q -m slow

# The docs' measured tables, rendered again from docs/results/*.json.
docs: setup
	$(PY) -m collage_tvm.tools.docs

clean:
	rm -rf $(VENV) *.egg-info out
