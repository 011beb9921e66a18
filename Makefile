# The two commands of the README: `make demo` and `make test`. Each builds its own venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# Where torch comes from. Empty: pip's configured index (PyPI by default, whose Linux x86_64
# torch is the CUDA build, several GB). For the CPU-only build, e.g.:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

# nemo-automodel in a virtualenv of its own (it pins transformers 5.18.0; the test venv has the
# transformers extra's 5.25.0), for tests/test_nemo_recipe.py. Its checkpoint and recipe code
# with what that imports, not its GPU kernels: triton, cutlass, quack-kernels, flashoptim and
# torchao (NeMo imports triton only if it is installed) nor its data-set tooling (datasets,
# pyarrow, pandas) or megatron-fsdp. About 1.2 GB instead of 2.9 GB for the full install.
NEMO_VENV := $(VENV)/nemo-venv
NEMO ?= nemo-automodel==0.7.0
NEMO_DEPS ?= transformers==5.18.0 torchdata pyyaml

.PHONY: demo test test-slow lint bench venv nemo-venv clean

$(BIN)/.installed: pyproject.toml
	@echo "set-up: creating $(VENV) with $$($(PY) --version)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "set-up: installing $(TORCH)$(if $(TORCH_INDEX), from $(TORCH_INDEX)) (the largest download; pip is quiet meanwhile)"
	$(BIN)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "set-up: installing asyncckpt (editable) with its test and dev tools and the Lightning and transformers extras"
	# the torch pin again, so that no extra's dependency can swap the build installed above
	$(BIN)/pip install -q -e ".[test,dev,lightning,transformers]" "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@echo "set-up: nemo-automodel's own files for tests/test_nemo_stale_mkdir.py (its 3.8 MB wheel, no dependencies)"
	$(BIN)/pip install -q --no-deps --target $(VENV)/nemo-automodel nemo-automodel==0.7.0
	@echo "set-up: torchtitan 0.3.0's own files for tests/test_torchtitan.py (~17 MB in .venv/torchtitan; see tests/support/_torchtitan.py)"
	# --no-deps: torch stays the build above; the five packages are what its trainer components import
	$(BIN)/pip install -q --no-deps --target $(VENV)/torchtitan torchtitan==0.3.0 tyro==1.0.17 \
		docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 torchdata==0.11.0
	@$(BIN)/python -c "import torch; print('set-up: done, torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU-only build)')"
	touch $@

venv: $(BIN)/.installed

$(NEMO_VENV)/.installed: pyproject.toml | $(BIN)/.installed
	@echo "set-up: $(NEMO) and the dependencies its checkpoint code imports, in $(NEMO_VENV)"
	$(PY) -m venv $(NEMO_VENV)
	$(NEMO_VENV)/bin/pip install -q --upgrade pip
	$(NEMO_VENV)/bin/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(NEMO_VENV)/bin/pip install -q --no-deps "$(NEMO)"
	$(NEMO_VENV)/bin/pip install -q -e . $(NEMO_DEPS) "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

nemo-venv: $(NEMO_VENV)/.installed

demo: venv
	$(BIN)/python examples/demo_kill_resume.py

# `make test`: the tests mostly wait on subprocesses, sleeps and deadlines, so 4 pytest-xdist
# workers on a 2-core machine (TEST_WORKERS=0: one process). Whole files go to one worker, so a
# module's fixtures (a SeaweedFS, a reference training run) start once; tests/conftest.py puts
# the longest files first. Then the tests marked `timing` (tight wall-clock bounds) run alone.
# `make test-slow` runs the long variants marked `slow` (.ci/run runs both).
TEST_WORKERS ?= 4
PYTEST := $(BIN)/python -m pytest -q --durations=20
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# a phase that selects no test (exit 5, e.g. PYTEST_ARGS naming one file) is no failure; both are
BOTH_PHASES = for s in $$a $$b; do [ $$s = 0 ] || [ $$s = 5 ] || exit $$s; done; [ $$a$$b != 55 ] || exit 5

# the files that hold a `timing` test: the serial phase collects only these (~10 s less of imports)
TIMING_FILES = $(shell grep -l "mark.timing" tests/test_*.py)

test: venv nemo-venv lint
	$(PYTEST) $(XDIST) -m "not slow and not timing" $(PYTEST_ARGS); a=$$?; \
	$(PYTEST) -m "timing and not slow" $(PYTEST_ARGS) $(if $(filter tests/%,$(PYTEST_ARGS)),,$(TIMING_FILES)); b=$$?; $(BOTH_PHASES)

test-slow: venv nemo-venv
	$(PYTEST) $(XDIST) -m "slow and not timing" $(PYTEST_ARGS); a=$$?; \
	$(PYTEST) -m "slow and timing" $(PYTEST_ARGS); b=$$?; $(BOTH_PHASES)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: venv
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
