# Two commands set everything up on a fresh machine (Python >= 3.10, a C/C++ compiler, cmake):
#   make run    - build the environment and generate text with the embedded default model
#   make test   - build the environment and run the test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
EXTRAS ?= dev,tui,server,train
PROMPT ?= Question: What is the tallest mountain in the world?\nAnswer: Mount Everest.\nQuestion: What is the longest river in the world?\nAnswer:

.PHONY: run test env clean

# native/ is compiled by the package build: editing it re-runs the (editable) install.
NATIVE_SRC := setup.py $(wildcard native/*.c native/*.h)

$(VENV)/.installed: pyproject.toml $(NATIVE_SRC)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@

env: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/localspec generate "$$(printf '$(PROMPT)')" --max-tokens 128 --temperature 0 --compare

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info localspec/native/_lsnative*
