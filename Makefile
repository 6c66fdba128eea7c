# The two commands of the README: `make app` (set up, start the app on the sample run) and
# `make test` (set up, run every test). Both create .venv on first use.
.PHONY: setup app test lint sample bench

setup:
	@bash scripts/setup.sh

app: setup
	.venv/bin/streamlit run app/main.py --server.headless true --browser.gatherUsageStats false

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

sample: setup
	.venv/bin/traceprop sample

bench: setup
	.venv/bin/traceprop bench overhead --json benchmarks/results/overhead.json
