"""LDS of the engine's own preconditioners on a copy of an eval dir's run (no retrain).
usage: engine_lds.py EVAL_DIR RUN_NAME TAG [kind:damping:cos ...]"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.evaluate.lds_report import lds_scores, summarize
from traceprop_engine.settings import IndexSettings

eval_dir, run_name, tag = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
losses = np.load(eval_dir / "losses.npy")
sub = json.loads((eval_dir / "subsets.json").read_text())
n_train = sub["n_train"]
masks = np.zeros((len(sub["subsets"]), n_train), bool)
for j, s in enumerate(sub["subsets"]):
    masks[j, s["members"]] = True
dst = eval_dir / "scratch" / f"{run_name}-{tag}"
if dst.exists():
    shutil.rmtree(dst)
shutil.copytree(eval_dir / "runs" / run_name, dst, ignore=shutil.ignore_patterns("index"))
run = open_run(dst)
ex = run.examples()
eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
sk = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
out = {}
for spec in sys.argv[4:]:
    kind, damp, cos = spec.split(":")
    ix = IndexSettings(preconditioner=kind, damping=float(damp), cosine=cos == "cos")
    _, ids, pre = run.index(ix)
    scores = np.zeros((len(eval_ids), n_train))
    for r, t in enumerate(sk):
        scores[r, ids] = run.all_scores(t, ix)
    res = summarize(lds_scores(scores, masks, losses), 1000)
    out[spec] = res
    scale = [round(lp.info.get("layer_scale", float("nan")), 3) for lp in pre.layers]
    print(
        f"{tag} {spec:22s} {res['lds']:.3f} [{res['ci_low']:.3f}, {res['ci_high']:.3f}] scale={scale}",
        flush=True,
    )
(eval_dir / f"engine-{run_name}-{tag}.json").write_text(json.dumps(out, indent=1))
