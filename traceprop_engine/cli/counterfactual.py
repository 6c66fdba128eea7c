"""``traceprop counterfactual``: retrain without a query's top-k proponents (and without k random
examples as the control) and report the change of the query's loss."""

from __future__ import annotations

import json
import os

from .. import constants as C


def register(sub) -> None:
    p = sub.add_parser(
        "counterfactual",
        help="check a ranking: retrain without the query's top-k proponents vs k random examples",
        description="Retrain the run's model (same recipe, same seeds) on all its training examples, "
        "without the query's top-k proponents, and without k random other examples, for --seeds "
        "seeds; print the change of the query's loss for both removals with its spread. The result "
        "is saved to RUN/counterfactual/<key>.json (or --out DIR/<key>.json) and printed again "
        "(without retraining) on a rerun.",
    )
    p.add_argument("run", help="run directory (a completed run small enough to retrain)")
    p.add_argument("--prompt", required=True, help="the query's prompt")
    p.add_argument("--completion", required=True, help="the completion whose origin is checked")
    p.add_argument(
        "--top-k", type=int, default=10, help="how many proponents to remove (default 10)"
    )
    p.add_argument("--seeds", type=int, default=3, help="training seeds per arm (default 3)")
    p.add_argument(
        "--preconditioner",
        default=C.DEFAULT_PRECONDITIONER,
        help=f"which ranking to check (default {C.DEFAULT_PRECONDITIONER})",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for the result, progress and work files (default RUN/counterfactual; "
        "give one for a read-only or bundled run: nothing is then written into the run)",
    )
    p.add_argument("--force", action="store_true", help="recompute even when a result is saved")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=_cmd)


def format_result(doc: dict) -> str:
    """The result as a few lines of text."""
    ch = doc["change"]
    n = len(doc["seeds"])
    k = doc["settings"]["top_k"]
    lines = [
        f"query loss of the run's model {doc['original_loss']:.4f}; retrained on all "
        f"{doc['n_train']} examples: {sum(doc['losses']['full']) / n:.4f} (mean of {n} seeds)",
    ]
    for arm, what in (
        ("top_k", f"without the top-{k} proponents"),
        ("random", f"without {k} random examples"),
    ):
        c = ch[arm]
        spread = (
            f" ± {c['std']:.4f} (std over {n} seeds, sem {c['sem']:.4f})"
            if c["std"] is not None
            else " (one seed: no spread; use --seeds 2 or more)"
        )
        lines.append(f"{what:>34}: loss change {c['mean']:+.4f}{spread}")
    lines.append(f"top-k removal minus random removal: {ch['top_k_minus_random']:+.4f}")
    return "\n".join(lines)


def _cmd(a) -> int:
    os.environ.setdefault("TQDM_DISABLE", "1")  # one line per retrain in the log, not bars
    from ..evaluate.counterfactual import (
        CounterfactualSpec,
        load_result,
        result_path,
        run_with_progress_file,
    )

    spec = CounterfactualSpec(a.prompt, a.completion, a.top_k, a.seeds, a.preconditioner)
    doc = None if a.force else load_result(a.run, spec, a.out)
    if doc is None:
        doc = run_with_progress_file(a.run, spec, a.out)
    print(json.dumps(doc, indent=1) if a.json else format_result(doc))
    if not a.json:
        print(f"saved: {result_path(a.run, spec, a.out)}")
    return 0
