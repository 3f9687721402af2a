# Two commands on a fresh machine: `make book` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# force: the book build executes every chapter; off: render the outputs already
# in the notebooks (CI executes them once, with nbmake, and renders those).
EXECUTE ?= force
# NB_OVERWRITE=1 makes nbmake execute the chapters in book/ itself and write their outputs
# there (CI clones only).
NB_OVERWRITE ?=
NBMAKE_FLAGS := --nbmake --nbmake-timeout=600 --timeout=900 --overwrite --durations=0
# The folder `make book` builds from: `.` (book/ itself) or a copy of the sources.
BOOK_SRC ?= .
# Where `make test` executes the chapters and renders them from: book/ itself with
# NB_OVERWRITE=1, otherwise a copy of the sources in _executed/ (tools/mirror_book.py),
# so that book/ stays free of outputs. Either way each chapter executes once.
EXECUTED := $(if $(NB_OVERWRITE),.,_executed)
# require.js, the widget manager and MathJax, served by the book itself (see _config.yml).
BOOK_JS := _build/book-js/_vendor/VERSIONS.json
# Extra arguments for `make lab`, e.g. LAB_ARGS="--no-browser --port 8890".
LAB_ARGS ?=

.PHONY: help install slurm-packages book book-js test test-package test-fast test-slow lint typecheck test-notebooks \
	render linkcheck test-browser test-lab ran-check lab bench gpu-check gpu-sim gpu-sim-chapters clean

help:
	@echo "make book        install (into $(VENV)) and build the HTML book in _build/html"
	@echo "make test        install; package tests, every chapter once, the rendered book"
	@echo "                 (links, then every page in headless Chromium; screenshots in"
	@echo "                 _build/screenshots)"
	@echo "make ran-check   (make test's last step) each book program that never ran as its Run: line types it"
	@echo "make test-fast   the package tests that start no process (seconds to a minute or two)"
	@echo "make lint        ruff (rules in pyproject.toml) and mypy on the package (strict on core)"
	@echo "make lab         open the chapters in JupyterLab"
	@echo "make bench       run every benchmark suite in full, saved in book/measurements/ for the appendix"
	@echo "make gpu-check   on a GPU machine: every chapter and benchmark with CUDA"
	@echo "make gpu-sim     on the CPU: the workers, programs and chapters as if it had GPUs"
	@echo "make test-lab    execute every chapter through a JupyterLab kernel"
	@echo "make slurm-packages  apt-get install slurm-wlm munge (chapter 18), if missing"

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

install: $(STAMP)

# Slurm and munge for chapter 18 (Debian's packages, as root), when they are missing.
slurm-packages:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge

$(BOOK_JS): tools/fetch_book_js.py tools/widget_setup.js | $(STAMP)
	$(PY) tools/fetch_book_js.py _build/book-js
	touch $(BOOK_JS)

book-js: $(BOOK_JS)

book: $(STAMP) $(BOOK_JS)
	rm -rf _build/.jupyter_cache
	mkdir -p _build
	@test -f $(BOOK_SRC)/_toc.yml || { echo "error: no _toc.yml in $(BOOK_SRC) (run make test-notebooks first)" >&2; exit 1; }
	sed 's/execute_notebooks: force/execute_notebooks: "$(EXECUTE)"/' _config.yml > _build/build_config.yml
	$(VENV)/bin/jupyter-book build $(BOOK_SRC) --path-output . -W -n --keep-going \
	  --config _build/build_config.yml
	@echo "The book is in _build/html/index.html"

# One step after another, so that `make -j test` keeps the order. The runner records every
# command it execs into $(RAN) (package tests and chapters alike); `make ran-check` afterwards
# names each book program that never ran as its docstring's Run: line types it
# (ddpguide/launch/ran.py); it is `make test`'s last step, so that it skips nothing before it.
RAN := $(CURDIR)/_build/ran
test: $(STAMP)
	rm -rf $(RAN)
	DDPGUIDE_RAN=$(RAN) $(MAKE) --no-print-directory test-package
	DDPGUIDE_RAN=$(RAN) $(MAKE) --no-print-directory test-notebooks
	DDPGUIDE_RAN=$(RAN) $(MAKE) --no-print-directory gpu-sim-chapters
	$(MAKE) --no-print-directory render
	$(MAKE) --no-print-directory linkcheck
	$(MAKE) --no-print-directory test-browser
	$(MAKE) --no-print-directory ran-check

ran-check:
	$(PY) -m ddpguide.launch.ran $(RAN)

# Two pytest-xdist workers: about half of the package tests' time is spent waiting (a
# collective's timeout, an agent that joins late), which the other worker fills. A file's
# tests run in one worker (tests/worker_groups.py); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test-package: $(STAMP)
	$(PY) -m pytest tests --ignore=tests/browser --durations=60 -n $(TEST_WORKERS) --dist loadgroup

# Every package test that starts no process: no process group, no subprocess. A test that
# starts one is marked `multiprocess` (tests/process_marks.py) and left out here.
test-slow: $(STAMP)
	DDPGUIDE_SLOW=1 $(PY) -m pytest tests -m slow -v

test-fast: $(STAMP)
	$(PY) -m pytest tests --ignore=tests/browser -m "not multiprocess" -q --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The chapters whose outputs show times measured as they run (collectives' bandwidth, AMP's
# speed, the cluster's links, the planner's and the failures' measured steps) run one at a
# time, so that nothing else shares the machine while they measure. The others, which mostly
# wait (on agents, timeouts and joins: one at a time they leave about 44% of two cores idle),
# run first, two at a time in two pytest-xdist workers.
ALONE_CHAPTERS := 02_collectives 07_amp 15_cluster 16_plan 17_failures
CHAPTER_WORKERS ?= 2
NB_DIR := $(EXECUTED)/book

test-notebooks: $(STAMP)
ifeq ($(NB_OVERWRITE),)
	$(PY) tools/mirror_book.py $(EXECUTED)
endif
	$(PY) -m pytest $(NBMAKE_FLAGS) -n $(CHAPTER_WORKERS) --dist worksteal \
	  $(foreach c,$(ALONE_CHAPTERS),--ignore=$(NB_DIR)/$(c).ipynb) $(NB_DIR)
	$(PY) -m pytest $(NBMAKE_FLAGS) $(foreach c,$(ALONE_CHAPTERS),$(NB_DIR)/$(c).ipynb)

# The HTML of the notebooks that test-notebooks executed, without executing them again.
render:
	$(MAKE) --no-print-directory book EXECUTE=off BOOK_SRC=$(EXECUTED)

# Links inside the book (external links are listed in linkcheck_ignore).
linkcheck: $(STAMP) $(BOOK_JS)
	rm -rf _build/linkcheck
	sed 's/execute_notebooks: force/execute_notebooks: "off"/' _config.yml > _build/linkcheck_config.yml
	$(VENV)/bin/jupyter-book build . --builder linkcheck --path-output _build/linkcheck \
	  -W --keep-going --config _build/linkcheck_config.yml

# Every page of the built book in headless Chromium (needs `make book` or `make render`).
test-browser: $(STAMP)
	$(PY) -m pytest tests/browser

# Every chapter through a JupyterLab kernel, as a reader runs it (not part of `make test`:
# test-notebooks already executes each chapter with the same kernel).
test-lab: $(STAMP)
	DDPGUIDE_LAB_CHAPTERS=1 $(PY) -m pytest tests/test_lab_execution.py

lab: $(STAMP)
	$(PY) tools/lab.py $(LAB_ARGS)

bench: $(STAMP)
	mkdir -p book/measurements
	for suite in $$($(PY) -c "from ddpguide.bench import SUITES; print(*SUITES)"); do \
	  $(PY) -m ddpguide.bench $$suite --json book/measurements/$$suite.json || exit 1; done

gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py

# A machine with GPUs simulated on the CPU (ddpguide/core/gpusim.py): the simulation's own
# refusals, the package's workers and the programs at 1, 2 and 8 GPUs (tests/gpusim, part of
# test-package too), then the chapters in GPU_SIM_CHAPTERS at 2 simulated GPUs.
GPU_SIM_CHAPTERS ?= book/08_sharded_data_parallel.ipynb book/11_context_parallel.ipynb \
	book/12_mixture_of_experts.ipynb
# Every chapter that passes at 2 simulated GPUs (`make gpu-sim` runs them all; `make test` only
# GPU_SIM_CHAPTERS). Seconds of each, one at a time on the 2-core machine under load 3-12 (other
# jobs beside them): appendix 27, 01 92, 02 68, 03 76, 04 121, 05 121, 06 182, 07 37,
# 08 178, 09 278, 10 140, 11 139, 12 58, 13 38, 14 71, 15 41, 16 137, 17 55, 18 164.
# 07's SyncBatchNorm runs on the simulated GPUs (ddpguide/core/gpusim_syncbn.py); 09's CUDA mesh
# is a CPU one that says cuda outside torch. 18 includes its Slurm jobs: client_env() keeps the
# simulation's variables.
GPU_SIM_ALL_CHAPTERS ?= book/appendix_measurements.ipynb book/01_spawn_ddp.ipynb \
	book/02_collectives.ipynb book/03_torchrun.ipynb book/04_elastic.ipynb \
	book/05_model_parallel.ipynb book/06_sbp.ipynb book/07_amp.ipynb $(GPU_SIM_CHAPTERS) \
	book/09_tensor_parallel.ipynb book/10_debugging.ipynb \
	book/13_pipeline_schedules.ipynb book/14_gpt_capstone.ipynb \
	book/15_cluster.ipynb book/16_plan.ipynb book/17_failures.ipynb book/18_slurm.ipynb
gpu-sim: $(STAMP)
	$(PY) -m pytest tests/gpusim -n $(TEST_WORKERS) --dist loadgroup -q
	$(MAKE) --no-print-directory gpu-sim-chapters GPU_SIM_CHAPTERS="$(GPU_SIM_ALL_CHAPTERS)"

# The chapters alone (`make test` runs tests/gpusim in test-package, then these); nbmake
# executes them without writing their outputs.
gpu-sim-chapters: $(STAMP)
	DDPGUIDE_SIMULATE_GPUS=2 PYTHONPATH=$(CURDIR)/ddpguide/core/gpusim_site:$(CURDIR) \
	  $(PY) -m pytest --nbmake --nbmake-timeout=600 --durations=0 $(GPU_SIM_CHAPTERS) -n $(CHAPTER_WORKERS) -q

clean:
	rm -rf _build _executed
