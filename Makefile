# make demo   installs everything it needs, then runs the whole pipeline on the embedded digits data
# make demo-detection  the same, plus detection on the digit scenes (longer)
# make test   installs everything it needs, then runs the test suite (the real-Slurm tests beside the others)
# make test-fast  the unit tier only: the tests not marked slow or slurm (about a minute on an AVX-512 EPYC, 5 on an AVX2-only one)
# make bench  loader and hard-view-selection benchmarks (tables + JSON under bench/)
# make bench-peers  installs lightly (the peer library, not a dependency of the package), then this project against it on Fashion-MNIST
# make gpu-wheels  the wheels the GPU lease's image lacks (Python 3.12, no registry there) in .whl/: python -m launch wheels
# make gpu-check  on a machine with a CUDA GPU: the GPU-only tests, the step against a plain loop, the GPU throughput (8 min)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_INSTALL := $(VENV)/bin/uv pip install -q --python $(PY)
APT_PACKAGES := pkg-config libopencv-dev libturbojpeg0-dev dataset-fashion-mnist

.PHONY: install demo demo-detection test test-fast bench bench-peers gpu-wheels gpu-check clean-runs

install: $(VENV)/.installed

# FFCV compiles against OpenCV and libjpeg-turbo; dataset-fashion-mnist holds the benchmark's IDX files. The packages
# come from the package registry, installed by uv (pip installs uv, and brings itself up to date for the Detectron2
# build of docs/transfer.md): uv downloads, unpacks and compiles to bytecode on every core, where pip does one file
# at a time (a cold install took 117 s instead of 242 s on the slow-CPU model of tests/slow_cpu.py, about 52 s
# instead of 92 s on the AVX-512 EPYC; docs/tests.md). torch and torchvision are the registry's CUDA build (it runs
# on CPUs too); uv does not read pip's configuration, which may point at a local CPU-only torch wheel with which
# torchvision's compiled ops do not load (as `pip --isolated` does not).
$(VENV)/.installed: pyproject.toml
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
		else echo "FFCV and the Fashion-MNIST benchmark need the Debian packages: $(APT_PACKAGES) (run as root, or: sudo apt-get install $(APT_PACKAGES))"; exit 1; fi; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --isolated install -q --upgrade pip uv==0.13.10
	$(UV_INSTALL) --compile-bytecode -e ".[test]"
	touch $@

demo: install
	$(PY) -m launch.demo

demo-detection: install
	$(PY) -m launch.demo --detection

# Both pytests scale their waits by one factor measured here first (tests/machine_speed.py: a reference step against
# the CPU the suite was tuned on). The real-Slurm tests (-m slurm) spend most of their minutes (4-8) waiting for the
# scheduler (time limits of minutes, requeues, KillWait): they run in a pytest of their own beside the others, their
# report printed after the others'.
# The suite fails when either fails. The others run in two pytest workers (pytest-xdist), each test file in one of
# them (--dist loadfile: a file's module-scoped fixtures are built once): one pytest left the 2 cores idle more than
# half the time (waiting on the processes and jobs it starts: user + sys 191 s in 336 s of wall on two test files
# of the AVX2-only EPYC), and two workers took 850 s for what one took 1,634 s (docs/tests.md). (A background job
# of make's shell starts with Ctrl-C ignored: its pytest takes Ctrl-C back, so that it stops its Slurm cluster on an
# interrupt as the others' pytest does.) `make test TEST_WORKERS=N` sets the others' workers. A worker that dies
# (a segmentation fault, pytest-timeout's exit) is not replaced: the run fails naming the test it was in, where
# pytest-xdist 3.8 with --dist loadfile gave a replacement no work and waited for it forever (pytest-xdist #784).
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0
SLURM_TESTS := import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(["-m", "slurm"]))
test: install
	@slowness=$${HARDVIEW_TEST_SLOWNESS:-$$($(PY) -m tests.machine_speed)} || exit 1; \
	export HARDVIEW_TEST_SLOWNESS=$$slowness; \
	echo "== this machine against the suite's reference CPU: waits scaled by $$HARDVIEW_TEST_SLOWNESS (tests/machine_speed.py)"; \
	slurm_log=$$(mktemp); \
	$(PY) -c '$(SLURM_TESTS)' > $$slurm_log 2>&1 & slurm_tests=$$!; \
	trap 'kill -INT $$slurm_tests 2>/dev/null; wait $$slurm_tests; cat $$slurm_log; rm -f $$slurm_log; exit 130' INT TERM; \
	$(PY) -m pytest -m "not slurm" $(PYTEST_WORKERS); others=$$?; \
	wait $$slurm_tests; slurm=$$?; \
	echo "== the real-Slurm tests (pytest -m slurm), run beside the others:"; cat $$slurm_log; rm -f $$slurm_log; \
	echo "== pytest -m 'not slurm': exit status $$others; pytest -m slurm: exit status $$slurm"; \
	test $$others = 0 -a $$slurm = 0

test-fast: install
	$(PY) -m pytest -m "not slow and not slurm" $(PYTEST_WORKERS)

bench: install
	$(PY) -m pretrain.bench loader
	$(PY) -m pretrain.bench hvs

# lightly 1.6 over this project's torch / torchvision: --no-deps keeps uv from replacing them (its transforms import
# lightning_utilities, nothing else of its requirements is needed for what the benchmark uses).
bench-peers: install
	$(UV_INSTALL) --no-deps lightly==1.6.0 lightning-utilities==0.15.3
	$(PY) -m pretrain.bench peers --seeds 0 1 2

# What a machine without a package registry lacks, as wheels for its Python: here the GPU lease's image
# (configs/launch/gpu_lease_packages.txt); carry .whl there and `python3 -m pip install --no-index --no-deps .whl/*.whl`.
# FFCV and DeepSpeed are built here with a Python 3.12: BUILD_PYTHON=PATH names one, else uv finds one.
gpu-wheels: install
	rm -rf .whl
	$(PY) -m launch wheels --have configs/launch/gpu_lease_packages.txt --python-version 3.12 --out .whl $(if $(BUILD_PYTHON),--build-python $(BUILD_PYTHON))

gpu-check: install
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here. Run it on a machine with one; the CPU tests are make test.')"
	$(PY) -m pretrain.bench gpu-check

clean-runs:
	rm -rf runs/demo
