# The two commands: `make demo` runs the main job, `make test` runs every test.
# Both set up what they need on a fresh machine (virtual environment, system packages).
# `make lint` checks the code: ruff's rules and formatting, and mypy (settings in pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test matrix agent system venv benchmarks clean lint render gpu-check

demo: $(STAMP)
	$(PY) -m mscale demo $(ARGS)

# Two workers (pytest-xdist), a test file each at a time: module fixtures (a compiled model, a
# service) stay shared within their file. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
test: system $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not matrix" $(PYTEST_ARGS)

# The forward-progress matrix alone (tests/test_progress_matrix.py; `make test` runs it too, its cells
# but those marked `matrix`, none now; its doc gives what each cell costs).
matrix: system $(STAMP)
	$(PY) -m pytest -m "" tests/test_progress_matrix.py $(PYTEST_ARGS)

# ruff over the project (mscale/, tests/, benchmarks/; .gitignore and extend-exclude respected),
# mypy over the packages [tool.mypy] names. Fix formatting with `$(VENV)/bin/ruff format`.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

agent: $(STAMP)
	$(PY) -m mscale agent --simulate mscale/sim/timelines/default.yaml $(ARGS)

system:
	@bash scripts/setup-system.sh

venv: $(STAMP)

# Through constraints.txt: the exact versions this machine carries and CI tests (torch 2.13.0,
# the CPU wheel), which the package's metadata leaves open (it states only lower bounds).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[hook,dev]'
	# BCC is Debian's python3-bpfcc: make its module importable from the venv.
	# Link only the bcc package, not all of dist-packages, so nothing else leaks in.
	mkdir -p $(VENV)/debian-bcc && ln -sfn /usr/lib/python3/dist-packages/bcc $(VENV)/debian-bcc/bcc
	echo $(abspath $(VENV))/debian-bcc > $$($(PY) -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/debian_bcc.pth
	touch $(STAMP)

# Re-render the committed rules, docs/alerts.md, docs/runbooks.md, dashboard JSON and the Kubernetes
# renders (their PrometheusRule comes from the same params.yaml) from params.yaml.
render: $(STAMP)
	$(PY) -m mscale.rules.render
	$(PY) -m mscale.dashboards.build
	bash deploy/kubernetes/render.sh

# Every benchmark at its quick default (under 20 minutes on 2 cores), each verdict on the median
# of its repeats; every figure into one JSON file (BENCH_JSON), the table printed from it at the end.
# the table of docs/benchmarks.md: .venv/bin/python benchmarks/_table.py FILE --readme docs/benchmarks.md (see docs in the script).
BENCH_JSON ?= benchmarks/results/latest.json
benchmarks: $(STAMP)
	rm -f $(BENCH_JSON)
	for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b --json $(BENCH_JSON) || exit 1; done
	$(PY) benchmarks/_table.py $(BENCH_JSON)

# The one device check, on a machine with an NVIDIA GPU (under 8 minutes): every gpu-marked
# test and the CUDA measurements, report in gpu-check/. Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out gpu-check $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache mscale-demo
