# Two commands set everything up on a fresh machine (Python >= 3.10, a C/C++ compiler, cmake):
#   make run         - build the environment to run localspec (generate, chat, serve) and
#                      generate text with the embedded default model
#   make test        - add the test extras (pytest, torch for the training tests, scipy,
#                      matplotlib, the openai client), build the RPC worker, run the test suite
#   make rpc-server  - build llama.cpp's rpc-server for `localspec rpc-worker` (docs/rpc.md)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
RUN_EXTRAS ?= tui,server
TEST_EXTRAS ?= dev,tui,server,train
CXX ?= c++
PROMPT ?= Question: What is the tallest mountain in the world?\nAnswer: Mount Everest.\nQuestion: What is the longest river in the world?\nAnswer:

# llama-cpp-python is built from its sdist with llama.cpp's RPC backend (GGML_RPC=ON). pip's
# wheel cache keys on the sdist, not on CMAKE_ARGS, so the install below never uses a cached or
# prebuilt wheel (--no-cache-dir, a local sdist file) and a check after it fails clearly when
# the RPC backend is missing. The same sdist's rpc-server.cpp is the RPC worker.
LLAMA_CPP_VERSION := 0.3.36
SDIST_DIR := build/sdist
LLAMA_SDIST := $(SDIST_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz
RPC_CHECK := $(PY) -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)"
RPC_SERVER := $(VENV)/bin/localspec-rpc-server
RPC_SRC := build/rpc-server-src

.PHONY: run test env test-env clean rpc-server

# native/ is compiled by the package build: editing it re-runs the (editable) install.
NATIVE_SRC := setup.py $(wildcard native/*.c native/*.h)

$(LLAMA_SDIST):
	mkdir -p $(SDIST_DIR)
	$(PYTHON) -m pip download --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(SDIST_DIR)

$(VENV)/.installed: pyproject.toml $(NATIVE_SRC) $(LLAMA_SDIST)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	@$(RPC_CHECK) 2>/dev/null || { echo "building llama-cpp-python $(LLAMA_CPP_VERSION) with GGML_RPC=ON (several minutes)"; \
	  CMAKE_ARGS="-DGGML_RPC=ON $(CMAKE_ARGS)" $(PY) -m pip install --no-deps --force-reinstall --no-cache-dir $(LLAMA_SDIST); }
	$(PY) -m pip install -e ".[$(RUN_EXTRAS)]"
	@$(RPC_CHECK) || { echo "error: llama-cpp-python in $(VENV) has no RPC backend (a prebuilt or cached wheel?); run 'make clean env'"; exit 1; }
	touch $@

# The test extras on top of the running environment: its own stamp, so that `make run` then
# `make test` installs them, and a rebuilt running environment (newer .installed) redoes them.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -e ".[$(TEST_EXTRAS)]"
	touch $@

env: $(VENV)/.installed
test-env: $(VENV)/.installed-test

# rpc-server.cpp of the vendored llama.cpp, linked against this venv's own libggml: same
# protocol version, same CPU kernels as the host.
$(RPC_SERVER): $(VENV)/.installed $(LLAMA_SDIST)
	rm -rf $(RPC_SRC) && mkdir -p $(RPC_SRC)
	tar -xzf $(LLAMA_SDIST) -C $(RPC_SRC) --strip-components=3 \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/ggml/include \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/tools/rpc/rpc-server.cpp
	$(PY) -m localspec.cli.rpc $(RPC_SRC)/ggml/include/ggml-rpc.h
	LIB=$$($(PY) -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))") && \
	  $(CXX) -O2 -std=c++17 -I$(RPC_SRC)/ggml/include $(RPC_SRC)/tools/rpc/rpc-server.cpp -o $@ \
	    -L$$LIB -lggml -lggml-base -Wl,-rpath,$$LIB

rpc-server: $(RPC_SERVER)

run: $(VENV)/.installed
	$(VENV)/bin/localspec generate "$$(printf '$(PROMPT)')" --max-tokens 128 --temperature 0 --compare

# Two xdist workers, each pinned to its share of the CPUs (tests/conftest.py), whole files per
# worker (module fixtures are built once); TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test $(RPC_SERVER)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info localspec/native/_lsnative*
