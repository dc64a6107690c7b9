# The commands of the lnlib book (see README.md):
#   make book   build the book into _build/html (strict: zero warnings)
#   make pdf    build the PDF edition into _build/pdf/lnlib.pdf (strict; needs XeLaTeX:
#               installed when root, by tools/ensure_tex.sh)
#   make test   run every test: lnlib unit tests, nbval on every notebook (plain, with
#               torch's AVX2 kernels and with one thread), the strict book build, the
#               browser tests of tests/book (offline maths; every page at 400 px and 1280 px:
#               tests/book/test_phone.py; need Chromium: installed when root), the strict
#               PDF build and its tests (tests/pdf; need TeX: installed when root)
# Both create .venv (python3.11) and install requirements/lock.txt + lnlib when needed.

PYTHON  ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
LOCK    := requirements/lock.txt
NODEPS  := requirements/no-deps.txt
TORCH_CPU  := requirements/torch-cpu.txt
TORCH_CUDA := requirements/torch-cuda.txt
STAMP   := $(VENV)/.installed-lock
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

# Same options for authors and CI. nbval is strict (--nbval, not --nbval-lax): every
# stored output is compared, except what tools/nbval_sanitize.cfg masks (addresses, timings,
# figures) and cells tagged nbval-ignore-output (tools/nbval_tags.py).
NBVAL_OPTS := --nbval --nbval-sanitize-with tools/nbval_sanitize.cfg \
              --nbval-current-env --nbval-cell-timeout 120 -p no:cacheprovider
NBVAL      := $(BIN)/python -m pytest $(NBVAL_OPTS) $(NOTEBOOKS) -q
# --all: every page is re-read on every build (executed notebooks still come from the
# cache), so a warning in a page that did not change cannot hide in an incremental build.
JB_OPTS    := --all -W -n --keep-going

export PYDEVD_DISABLE_FILE_VALIDATION := 1
export JUPYTER_PLATFORM_DIRS := 1

.PHONY: book test unit nbval nbval-avx2 nbval-1thread chromium browser-test env clean \
        sync-url lock execute pdf pdf-test tex

# The execution cache is keyed on the notebooks' code cells only: a change to lnlib (its code or
# its committed results in lnlib/data) leaves them unchanged, so the cache is cleared then.
CACHE_DB := _build/.jupyter_cache/global.db

define CLEAR_STALE_CACHE
	@if [ -f $(CACHE_DB) ] && [ -n "$$(find lnlib -newer $(CACHE_DB) -type f -print -quit)" ]; then \
		echo "lnlib changed since the notebooks were cached: clearing _build/.jupyter_cache"; \
		rm -rf _build/.jupyter_cache; fi
endef

book: env
	$(CLEAR_STALE_CACHE)
	$(BIN)/jupyter-book build . $(JB_OPTS)
	@echo
	@echo "The book is in _build/html. Open: file://$(CURDIR)/_build/html/index.html"

# The PDF edition, from the same sources and execution cache as the web book (the same strict
# options; tools/build_pdf.py also fails on undefined references or citations, missing
# figures, characters missing from the fonts and missing pages).
pdf: tex env
	$(CLEAR_STALE_CACHE)
	$(BIN)/python tools/build_pdf.py

# XeLaTeX, latexmk, fonts and poppler-utils (Debian packages) for make pdf and its tests.
tex:
	@bash tools/ensure_tex.sh

# The tests of the built PDF (poppler-utils); they compare its figures with _build/html.
pdf-test: env tex
	$(BIN)/python -m pytest tests/pdf -q -p no:cacheprovider

# Chromium and TeX first: a missing browser or TeX stops the run before the long steps, with
# one line. The PDF is built after the book: make pdf puts a copy beside the HTML, where the
# front page links to it (tests/pdf checks both), and reads the notebooks from the cache.
test: chromium tex env
	$(MAKE) --no-print-directory chromium tex unit nbval nbval-avx2 nbval-1thread book \
	    browser-test pdf pdf-test

unit: env
	$(BIN)/python -m pytest tests --ignore=tests/book --ignore=tests/pdf -q -p no:cacheprovider

nbval: env
ifneq ($(NOTEBOOKS),)
	$(NBVAL)
else
	@echo "no notebooks yet"
endif

# The stored outputs must not depend on the CPU: run them again with torch's AVX2 kernels
# (not AVX-512) and with one thread, as on another machine. (Never set OPENBLAS_CORETYPE.)
nbval-avx2: env
ifneq ($(NOTEBOOKS),)
	ATEN_CPU_CAPABILITY=avx2 $(NBVAL)
endif

nbval-1thread: env
ifneq ($(NOTEBOOKS),)
	OMP_NUM_THREADS=1 $(NBVAL)
endif

chromium:
	@bash tools/ensure_chromium.sh

browser-test: env chromium
	$(BIN)/python -m pytest tests/book -q -p no:cacheprovider

env: $(STAMP)

# Re-install only when the lock files (or pyproject.toml) changed since the last install.
# Every pin carries its hashes; no-deps.txt holds the packages installed without their
# declared dependencies (see the comment in it).
# The lock is complete (pip-compile), so it installs without resolving dependencies. Its torch pin
# is PyPI's; where a machine has torch's CPU build (requirements/torch-cpu.txt, not on PyPI), that
# goes in first and satisfies the pin. PyPI's Linux build is the CUDA one, whose libraries
# (requirements/torch-cuda.txt) are added only when the torch installed declares them
# (tools/torch_deps.py lists what it lacks).
$(STAMP): $(LOCK) $(NODEPS) $(TORCH_CPU) $(TORCH_CUDA) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(TORCH_CPU) 2>/dev/null \
	    && echo "--- torch: the CPU build found on this machine ($(TORCH_CPU))" \
	    || echo "--- torch: no CPU build on this machine, PyPI's build (the lock's pin)"
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	@if [ -n "$$($(BIN)/python tools/torch_deps.py)" ]; then \
	    echo "--- torch is PyPI's CUDA build: installing its libraries ($(TORCH_CUDA))"; \
	    $(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(TORCH_CUDA); fi
	@unmet="$$($(BIN)/python tools/torch_deps.py)"; test -z "$$unmet" || \
	    { echo "torch's requirements are not met after the install: $$unmet" >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(NODEPS)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (lnlib)"
	touch $(STAMP)

# Execute a notebook in place (deterministically) so that it can be committed with outputs:
#   make execute NB=notebooks/01_motivation.ipynb
execute: env
	$(BIN)/python tools/execute_notebook.py $(NB)

# After changing repository.url in _config.yml: rewrite the notebooks' Colab setup cells.
sync-url: env
	$(BIN)/python tools/sync_repository_url.py

# Regenerate requirements/lock.txt from pyproject.toml's extras (notebooks, test, book) and
# build requirements with pip-tools: exact pins, their hashes, and after each pin the extra or
# package it comes from. Existing pins are kept where they still satisfy pyproject.toml; to
# move one, delete its entry from the lock file first. tools/lock_torch.py then moves a local
# torch build (X+cpu) into requirements/torch-cpu.txt, pins PyPI's X in the lock and writes
# requirements/torch-cuda.txt.
PIP_TOOLS := pip-tools==7.6.2
lock:
	rm -rf _build/lockvenv && $(PYTHON) -m venv _build/lockvenv
	_build/lockvenv/bin/python -m pip install --quiet $(PIP_TOOLS)
	_build/lockvenv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	    --no-emit-index-url --no-emit-find-links --all-build-deps \
	    --extra notebooks --extra test --extra book -o $(LOCK) pyproject.toml
	_build/lockvenv/bin/python tools/lock_torch.py _build/lockvenv/bin/pip-compile
	rm -rf _build/lockvenv

# On a machine with an NVIDIA GPU: the GPU tests and CuPy test variants (LNLIB_REQUIRE_GPU=1), the
# GPU benchmark, an ncu reading, compute-sanitizer memcheck/racecheck, each under its own time
# limit (under 8 minutes in all); at most 7 files in $(GPU_OUT), summary.txt first. Needs no .venv,
# installs nothing (the GPU machine has no network): it names what is missing and goes on.
GPU_OUT ?= _build/gpu
.PHONY: gpu-check
gpu-check:
	GPU_OUT=$(GPU_OUT) bash tools/gpu_check.sh

clean:
	rm -rf _build
