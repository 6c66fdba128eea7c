# The two commands of the README: `make app` (set up, start the app on the sample run) and
# `make test` (set up, run every test). Both create .venv on first use.
.PHONY: setup app test lint sample bench

setup:
	@bash scripts/setup.sh

app: setup
	.venv/bin/streamlit run app/main.py --server.headless true --browser.gatherUsageStats false

# every test, in two layers: the fast one first (a failure shows within minutes), then the slow
# end-to-end and real-browser tests (marked slow / browser); both always run, and the target
# fails if either does. One layer alone: `pytest -m "not slow and not browser"` / `-m slow`.
FAST_TESTS = not slow and not browser and not cuda
SLOW_TESTS = (slow or browser) and not cuda

test: setup
	.venv/bin/ruff check .
	@status=0; \
	echo "make test: fast layer (-m '$(FAST_TESTS)')"; \
	.venv/bin/python -m pytest -q -m "$(FAST_TESTS)" || status=1; \
	echo "make test: slow layer (-m '$(SLOW_TESTS)')"; \
	.venv/bin/python -m pytest -q -m "$(SLOW_TESTS)" || status=1; \
	exit $$status

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

sample: setup
	.venv/bin/traceprop sample

bench: setup
	.venv/bin/traceprop bench overhead --json benchmarks/results/overhead.json
