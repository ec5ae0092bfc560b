# make demo   installs everything it needs, then runs the whole pipeline on the embedded digits data
# make demo-detection  the same, plus detection on the digit scenes (longer)
# make test   installs everything it needs, then runs the test suite (the real-Slurm tests beside the others)
# make test-fast  the unit tier only: the tests not marked slow or slurm (about a minute)
# make bench  loader and hard-view-selection benchmarks (tables + JSON under bench/)
# make bench-peers  installs lightly (the peer library, not a dependency of the package), then this project against it on Fashion-MNIST
# make gpu-check  on a machine with a CUDA GPU: the GPU-only tests (tests/gpu), then the GPU throughput table
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := pkg-config libopencv-dev libturbojpeg0-dev dataset-fashion-mnist

.PHONY: install demo demo-detection test test-fast bench bench-peers gpu-check clean-runs

install: $(VENV)/.installed

# FFCV compiles against OpenCV and libjpeg-turbo; dataset-fashion-mnist holds the benchmark's IDX files. torch and torchvision come from the package registry
# (CUDA build, runs on CPUs too): `pip --isolated` ignores a local CPU-only torch wheel that pip may be
# configured to prefer, with which torchvision's compiled ops do not load.
$(VENV)/.installed: pyproject.toml
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
		else echo "FFCV and the Fashion-MNIST benchmark need the Debian packages: $(APT_PACKAGES) (run as root, or: sudo apt-get install $(APT_PACKAGES))"; exit 1; fi; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --isolated install -q --upgrade pip
	$(PY) -m pip --isolated install -q -e ".[test]"
	touch $@

demo: install
	$(PY) -m launch.demo

demo-detection: install
	$(PY) -m launch.demo --detection

# Two pytest processes, so that both cores work while one of them waits. Beside the others, one after the other: the
# real-Slurm tests (tests/test_launch_slurm.py, -m slurm), which spend most of their minutes (4-8) waiting for the
# scheduler (1-minute time limits, requeues, KillWait), then the multi-process files after it in TESTS_BESIDE.
# Every test runs once; the beside report is printed after the others', and the suite fails when either fails.
# Plain pytest processes, not pytest-xdist workers: an FFCV write forked from an xdist worker hung once
# (docs/tests.md). (A background job of make's shell starts with Ctrl-C ignored: its pytest takes Ctrl-C back, so
# that it stops its Slurm cluster on an interrupt as the others' pytest does.)
TESTS_BESIDE := tests/test_launch_slurm.py tests/test_distributed_equality.py tests/test_launch_benchmark.py \
	tests/test_smoco.py tests/test_dino.py
PYTEST_BESIDE := import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); \
	sys.exit(pytest.main(sys.argv[1:]))
test: install
	@beside_log=$$(mktemp); \
	$(PY) -c '$(PYTEST_BESIDE)' $(TESTS_BESIDE) > $$beside_log 2>&1 & beside=$$!; \
	trap 'kill -INT $$beside 2>/dev/null; wait $$beside; cat $$beside_log; rm -f $$beside_log; exit 130' INT TERM; \
	$(PY) -m pytest $(TESTS_BESIDE:%=--ignore=%); others=$$?; \
	wait $$beside; beside=$$?; \
	echo "== beside them: pytest $(TESTS_BESIDE)"; cat $$beside_log; rm -f $$beside_log; \
	echo "== pytest (the others): exit status $$others; pytest (beside them): exit status $$beside"; \
	test $$others = 0 -a $$beside = 0

test-fast: install
	$(PY) -m pytest -m "not slow and not slurm"

bench: install
	$(PY) -m pretrain.bench loader
	$(PY) -m pretrain.bench hvs

# lightly 1.6 over this project's torch / torchvision: --no-deps keeps pip from replacing them (its transforms import
# lightning_utilities, nothing else of its requirements is needed for what the benchmark uses).
bench-peers: install
	$(PY) -m pip --isolated install -q --no-deps lightly==1.6.0 lightning-utilities==0.15.3
	$(PY) -m pretrain.bench peers --seeds 0 1 2

gpu-check: install
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here. Run it on a machine with one; the CPU tests are make test.')"
	HARDVIEW_GPU_TESTS=1 $(PY) -m pytest tests/gpu
	$(PY) -m pretrain.bench gpu

clean-runs:
	rm -rf runs/demo
