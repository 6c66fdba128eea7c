#!/usr/bin/env bash
# Run every peer benchmark (each in its own venv, one after the other so they do not share the
# 2 cores), twice (suffix _r1, _r2) to see that each agrees with itself.  Logs in logs/.
set -uo pipefail
cd "$(dirname "$0")"
mkdir -p logs results
REPS=${REPS:-"1 2"}
for r in $REPS; do
  .venvs/logix/bin/python overhead_logix.py --repeats 40 --out overhead_logix_r$r > logs/overhead_logix_r$r.log 2>&1
  .venvs/bergson/bin/python overhead_bergson.py --repeats 40 --out overhead_bergson_r$r > logs/overhead_bergson_r$r.log 2>&1
  .venvs/dattri/bin/python overhead_dattri.py --repeats 40 --out overhead_dattri_r$r > logs/overhead_dattri_r$r.log 2>&1
  .venvs/kronfluence/bin/python posthoc_kronfluence.py --repeats 30 --out posthoc_kronfluence_r$r > logs/posthoc_kronfluence_r$r.log 2>&1
done
echo done
