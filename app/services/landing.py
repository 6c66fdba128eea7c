"""The landing page's data: the sample question, and what a preconditioner and a score mean."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import AppConfig

SAMPLE_RUN = "facts"
GROUND_TRUTH = "facts-data/ground_truth.json"

# one owner for the words the landing page and the Influencers help use
PRECONDITIONERS = {
    "kfac": "the default: each example's training gradients of the last epoch it was trained "
    "in, with each layer's input and output-gradient covariance divided out (K-FAC from the run's own statistics; the output head is left as "
    "recorded), compared by cosine, so directions that every example moves along count less. "
    "On our LDS benchmarks it is at or above identity on every LoRA fine-tune (nine of nine, "
    "+0.046 on the mean) and level with it on full fine-tunes (benchmarks/EVAL.md §1k).",
    "identity": "the training gradients as recorded, compared by cosine (TracIn). It needs no "
    "covariance: a run trained without statistics uses it. The "
    "second opinion most unlike K-FAC.",
    "ekfac": "K-FAC with its eigenvalues corrected from the stored records (EK-FAC): level "
    "with K-FAC on our benchmarks (within 0.01 on the mean), and the default of a pretrained "
    "classifier fine-tuned in full, where it scored above K-FAC on every run measured "
    "(benchmarks/EVAL.md §1r).",
}
SIGN_NOTE = (
    "A score > 0 marks a **proponent**: training on that example lowered the loss of the queried "
    "output (pushed the model toward it). A score < 0 marks an **opponent**: it pushed the model "
    "away from that output. The size says how much, relative to the other examples."
)


@dataclass(frozen=True)
class SampleQuestion:
    run_dir: Path
    prompt: str
    completion: str


def sample_question(cfg: AppConfig) -> SampleQuestion | None:
    """The first eval question of the bundled facts run (from its ground truth), or None when
    the sample run is not there."""
    run_dir = cfg.sample_runs / SAMPLE_RUN
    gt = cfg.sample_runs / GROUND_TRUTH
    if not (run_dir / "run.json").exists() or not gt.exists():
        return None
    try:
        first = json.loads(gt.read_text())["eval"][0]
        return SampleQuestion(run_dir, first["prompt"], first["completion"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def ask_sample(state, q: SampleQuestion) -> None:
    """Make the sample run active and fill the Influencers page with the sample question, to be
    answered as soon as that page opens."""
    state["runs_active"] = str(q.run_dir)
    state["runs_pick"] = str(q.run_dir)
    state["infl_mode"] = "typed"
    state["infl_prompt"] = q.prompt
    state["infl_completion"] = q.completion
    state["infl_autorun"] = True
