# Two commands set everything up and run it: `make book` and `make test`. `make lab` opens JupyterLab.
# Everything is installed by these rules into .venv (Python) and tools/vendor (npm), nothing by hand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default (a CPU-only machine takes the local 2.13.0 wheel). GPU users: see README.
TORCH_SPEC ?= torch==2.13.0
VENV_STAMP := $(VENV)/.installed
VENDOR_STAMP := book/_vendor/.installed

export NUMBA_CACHE_DIR := $(CURDIR)/.cache/numba
export JUPYTER_PLATFORM_DIRS := 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1
# matplotlib's font cache inside the checkout: one in ~/.cache lists the font files of whichever checkout's .venv
# built it, and goes stale when that .venv is removed (findfont warnings on stderr, which nbval counts as output)
export MPLCONFIGDIR := $(CURDIR)/.cache/matplotlib
export PATH := $(CURDIR)/$(BIN):$(PATH)

# Tests and notebooks run on two workers (pytest-xdist), a file or notebook per worker at a time: every timing
# verdict in them is a ratio measured side by side in one run, with a margin that holds on a busy machine
# (tools/stress_test_suite.sh runs the whole of `make test` with a busy CPU process beside it).
TEST_WORKERS ?= 2
# ...and each worker computes on one thread. torch's and Numba's OpenMP threads spin while they wait for each other:
# with two cores, two threads in a process and anything else running, four short trainings took ten times as long
# (6.6 s alone, 67 s beside one busy process; on one thread, 20 s beside it).
TEST_THREADS ?= 1
test: export OMP_NUM_THREADS = $(TEST_THREADS)
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
# NBVAL_FLAGS=-vv shows a failing cell's whole output (tools/stress_test_suite.sh sets it)
NBVAL := $(PYTEST) --nbval --nbval-cell-timeout=600 --nbval-sanitize-with tests/nbval_sanitize.cfg $(NBVAL_FLAGS)
NOTEBOOKS := book/chapters exercises/solutions

.PHONY: book book-stored test lab labs lint bench fio gpu clean

$(VENV_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[course,book,dev,integrations]"
	$(BIN)/python -c "import matplotlib.font_manager"  # its font cache, built once before the test workers start
	touch $@

# The static book serves require.js, the widget manager, MathJax and Vega itself (no CDN at read time).
$(VENDOR_STAMP): tools/vendor/package.json tools/vendor/package-lock.json
	cd tools/vendor && npm ci --no-audit --no-fund --loglevel=error
	rm -rf book/_vendor && mkdir -p book/_vendor/html-manager book/_vendor/mathjax book/_vendor/vega
	cp tools/vendor/node_modules/requirejs/require.js book/_vendor/require.min.js
	cp -r tools/vendor/node_modules/@jupyter-widgets/html-manager/dist/. book/_vendor/html-manager/
	cp -r tools/vendor/node_modules/mathjax/es5/. book/_vendor/mathjax/
	# the explorers' charts (minioffload/course/explore/ loads these from the page, never from a CDN)
	cp tools/vendor/node_modules/vega/build/vega.min.js tools/vendor/node_modules/vega-lite/build/vega-lite.min.js \
	  tools/vendor/node_modules/vega-embed/build/vega-embed.min.js book/_vendor/vega/
	rm -f book/_vendor/html-manager/*.map
	touch $@

book: $(VENV_STAMP) $(VENDOR_STAMP)
	$(BIN)/python tools/make_student_labs.py --book
	$(BIN)/jupyter-book build book --warningiserror --keep-going
	@echo "The book: $(CURDIR)/book/_build/html/index.html"

# Student copies of the labs, generated from exercises/solutions.
labs: $(VENV_STAMP)
	$(BIN)/python tools/make_student_labs.py

lint: $(VENV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: $(VENV_STAMP) $(VENDOR_STAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not book_html" tests
	$(NBVAL) $(NOTEBOOKS)
	$(MAKE) --no-print-directory book-stored
	$(PYTEST) -m book_html tests

# The book from the notebooks' stored outputs, without executing them again: `make test` runs it right after
# nbval has executed every chapter and checked that it reproduces those outputs. (`make book` executes.)
# Both book rules first write the lab pages, book/labs/ (git-ignored), from the labs' student copies.
book-stored: $(VENV_STAMP) $(VENDOR_STAMP)
	$(BIN)/python tools/make_student_labs.py --book
	mkdir -p book/_build
	sed 's/^  execute_notebooks: .*/  execute_notebooks: "off"/' book/_config.yml > book/_build/_config_stored.yml
	$(BIN)/jupyter-book build book --config book/_build/_config_stored.yml --warningiserror --keep-going

lab: $(VENV_STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root,)

bench: $(VENV_STAMP) fio
	@benches="$(filter-out bench/gpu_check.py bench/common.py,$(wildcard bench/*.py))"; \
	[ -n "$$benches" ] || echo "no benchmarks yet"; \
	echo "(bench/adam.py compares with DeepSpeed when it is installed: see bench/README.md)"; \
	for b in $$benches; do $(BIN)/python $$b || exit 1; done

# bench/swapper.py compares the NVMe swapper with fio on the same directory: install it where we can.
fio:
	@command -v fio >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null; } || \
	  echo "fio is not installed and could not be (needs root and apt-get): bench/swapper.py leaves its rows out"

# CuPy for the CUDA that the installed torch was built for (cupy-cuda12x or cupy-cuda13x); needs a CUDA build of torch.
gpu: $(VENV_STAMP)
	@major=$$($(BIN)/python -c "import torch; print((torch.version.cuda or '').split('.')[0])"); \
	[ -n "$$major" ] || { echo "this torch has no CUDA build: install one first (see README, On a CUDA machine)"; exit 2; }; \
	echo "torch is built for CUDA $$major: installing the gpu-cuda$$major extra"; \
	$(BIN)/python -m pip install --quiet -e ".[gpu-cuda$$major]"

# torchao's wheel, for bench/offload_step.py's comparison on a GPU machine that reaches no registry: the session that
# runs bench/gpu_check.py there carries bench/wheels (git-ignored). 0.17.0 is the release built for torch 2.11 (the GPU
# image's); its CPUOffloadOptimizer is plain Python. The wheel is cp310-abi3, so it serves any CPython >= 3.10 there.
TORCHAO_SPEC ?= torchao==0.17.0
.PHONY: wheels
wheels: $(VENV_STAMP)
	rm -rf bench/wheels && mkdir -p bench/wheels
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
	  --python-version 3.12 -d bench/wheels "$(TORCHAO_SPEC)"
	@kib=$$(du -sk bench/wheels | cut -f1); ls -l bench/wheels; \
	echo "bench/wheels: $$kib KiB (a run's carried files may total 64 MiB)"; \
	[ "$$kib" -lt 32768 ] || { echo "bench/wheels is over 32 MiB: too much to carry beside the tree"; exit 1; }

clean:
	rm -rf book/_build book/_vendor .cache
