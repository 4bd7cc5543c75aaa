# Two commands for a newcomer: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; GPU users install their own torch before `pip install phalanx`.
TORCH  ?= torch==2.13.0
# The ray extra at the release tests/e2e/test_ray.py was written against (its wheel brings no torch).
RAY    ?= ray[train]==2.60.0
# tests/e2e/test_torchtitan.py trains it under phalanx; its requirements are the `titan` extra
# (pyproject.toml says why torchtitan itself goes in without its own).
TORCHTITAN ?= torchtitan==0.3.0

.PHONY: venv test test-slow test-all test-faults gpu-check lint bytecode demo bench bench-comm bench-comm-link etcd clean

venv: $(VENV)/.installed

# What the demo needs: torch and phalanx with the examples' data (scikit-learn).
$(VENV)/.base: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[examples]"
	touch $@

# What the tests need on top: the test tools, the Hugging Face, Ray and torchtitan extras.
$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,examples,yaml,hf,ray,titan]" "$(RAY)"
	$(PY) -m pip install -q --no-deps "$(TORCHTITAN)"
	touch $@

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# Every test process imports phalanx; with PYTHONDONTWRITEBYTECODE set (as in CI) nothing
# would ever write its bytecode, and each process would compile it again (1.5 s of CPU here).
bytecode: venv
	$(PY) -m compileall -q src tests examples benchmarks

# The tier CI runs (under 10 minutes on 2 cores): every feature exercised for real once.
# Three pytest workers, one test file each at a time: most of a multi-process test's wall
# time is waiting (rendezvous, signals, deadlines): with two the cores sat idle 40% of
# the run (10.0 against 8.6 minutes with three, measured on this 2-core machine).
TEST_WORKERS ?= 3
test: lint bytecode
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The rest (about 65 minutes on 2 cores): larger worlds, every variant, full-length runs,
# the fault soaks (most of the time). Run it, or test-all, before a change that touches what they cover.
test-slow: venv bytecode
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow

test-all: lint bytecode
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "slow or not slow"

# Every fault-injection test, the short versions (also in `make test`) and the slow soaks.
test-faults: venv
	$(VENV)/bin/pytest -q -m faults tests/faults

# The checks only a CUDA machine can run (tests/gpu/, skipped without one), as one table
# (benchmarks/gpu_check.sh does the same from a fresh clone). On a machine whose python
# already has a CUDA torch: PYTHONPATH=src:. python benchmarks/gpu_check.py
gpu-check: venv
	$(PY) benchmarks/gpu_check.py

# Three etcd members on loopback (Debian: apt-get install -y etcd-server) until Ctrl-C; prints
# the --rdzv-backend etcd --rdzv-endpoint flags to launch with (tests/etcdkit.py).
etcd:
	PYTHONPATH=src $(PYTHON) -m tests.etcdkit

# The main job: 2 ranks through our launcher, first the hand-written loop, then the Trainer.
demo: $(VENV)/.base
	$(VENV)/bin/phalanx launch --nproc-per-node 2 examples/digits.py
	$(VENV)/bin/phalanx launch --nproc-per-node 2 examples/digits_trainer.py --no-resume --overwrite_output_dir

# The suite (benchmarks/suite.py, ~15 min): DDP step vs torch at worlds 2 and 4, the bucket
# sweep, the launcher's start-up; plots need matplotlib, the `bench` extra.
bench: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/suite.py

# Exact fp32 vs bf16, PowerSGD, local SGD and DiLoCo (~20 min); matplotlib only for its plot.
bench-comm: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/comm_methods.py

# The same behind a loopback shaped to LINK_GBIT Gbit/s (a network namespace; needs root):
# what the methods buy between machines. 2 is about two hosts on 1 Gbit/s Ethernet.
LINK_GBIT ?= 2
bench-comm-link: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/comm_methods.py --link-gbit $(LINK_GBIT)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
