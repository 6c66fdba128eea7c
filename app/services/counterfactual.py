"""The counterfactual check and the per-token view for the Influencers page.

The check retrains the run's model several times, so it runs as ``traceprop counterfactual`` in
its own process group (like a Launch job): its state lives on disk (``<key>.progress.json``, the
result ``<key>.json``), a closed tab neither kills nor orphans it, and a revisit shows the saved
result. The files go to the run's ``counterfactual/`` folder, except for a bundled sample run or
a run the app cannot write: those stay untouched and their checks go beside the user's runs
(:func:`results_dir`).
"""

from __future__ import annotations

import hashlib
import html
import os
import signal
import sys
import time
from pathlib import Path

from traceprop_engine.errors import TracepropError
from traceprop_engine.evaluate import counterfactual as cf

from . import config, model_worker
from .jobs import spawn_logged
from .queries import in_process, token_pieces


class CounterfactualError(TracepropError, RuntimeError):
    """The counterfactual check cannot be started."""


def results_dir(run_dir: str | os.PathLike, cfg: config.AppConfig | None = None) -> Path | None:
    """Where this run's checks are saved: None (the run's own ``counterfactual/``) for a user
    run the app can write; for a bundled sample run or a read-only one, a folder of its own
    under the runs root (named by the run and a hash of its path: two bundled copies never
    share results)."""
    cfg = cfg or config.AppConfig.from_env()
    p = Path(run_dir).resolve()
    if not config.is_sample(cfg, p) and os.access(p, os.W_OK):
        return None
    tag = hashlib.sha256(str(p).encode()).hexdigest()[:10]
    name = f"{config.sanitize_name(p.name)}-{tag}"
    return cfg.runs_root / config.BUNDLED_RESULTS_DIR / name / cf.CF_DIR


def spec_for(query: dict, top_k: int, seeds: int, preconditioner: str) -> cf.CounterfactualSpec:
    """The check of a query result's query (typed, or an eval example's prompt and completion).

    Raises:
        QueryError: the query has no prompt/completion (a classification or token-id query).
    """
    return cf.CounterfactualSpec(
        prompt=query.get("prompt") or "",
        completion=query.get("completion") or "",
        top_k=int(top_k),
        seeds=int(seeds),
        preconditioner=str(preconditioner),
    )


DEFAULT_K = 10
MAX_K = 100  # the form's bound: retrains of removals larger than this say little more


def k_range(run_dir: str | os.PathLike) -> tuple[int, int]:
    """``(default, most)`` proponents the check of this run can remove: the most is half the
    training examples (the control removes as many others), at most :data:`MAX_K`; the
    default is :data:`DEFAULT_K` (not the query's top-k: a long list is not what one removes)."""
    from traceprop_engine.run import RunManifest

    most = min(MAX_K, cf.max_top_k(RunManifest.load(run_dir).data.n_train or 0))
    return min(DEFAULT_K, most), most


def plan(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> dict:
    """Retrains and estimated seconds (raises when the run is too big to retrain)."""
    return cf.plan(run_dir, spec)


def state(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> dict:
    """``status`` none | running | completed | cancelled | failed, with done/total/message/error."""
    return cf.job_state(run_dir, spec, results_dir(run_dir))


def result(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> dict | None:
    return cf.load_result(run_dir, spec, results_dir(run_dir))


def command(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> list[str]:
    out = results_dir(run_dir)
    return [
        sys.executable,
        "-m",
        "traceprop_engine",
        "counterfactual",
        str(Path(run_dir).resolve()),
        "--prompt",
        spec.prompt,
        "--completion",
        spec.completion,
        "--top-k",
        str(spec.top_k),
        "--seeds",
        str(spec.seeds),
        "--preconditioner",
        spec.preconditioner,
        "--force",
        *(["--out", str(out)] if out is not None else []),
    ]


def start(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> dict:
    """Start the check in the background (its own process group, log beside the result).

    Raises:
        CounterfactualError: it is running already.
        RunError: the run is too big to retrain, or not complete.
    """
    if state(run_dir, spec)["status"] == "running":
        raise CounterfactualError("this check is running already")
    cf.plan(run_dir, spec)  # refuse too-big runs before starting anything
    where = results_dir(run_dir)
    out = cf.check_writable(run_dir, where)
    proc = spawn_logged(command(run_dir, spec), out / f"{spec.key()}.log", {"TQDM_DISABLE": "1"})
    # the child rewrites this file as soon as it starts; until then it says "starting"
    path = cf.progress_path(run_dir, spec, where)
    if not path.exists() or cf.job_state(run_dir, spec, where)["status"] != "running":
        cf._write_progress(
            path,
            {"pid": proc.pid, "status": "running", "done": 0, "total": 0, "message": "starting"},
        )
    return state(run_dir, spec)


def cancel(run_dir: str | os.PathLike, spec: cf.CounterfactualSpec) -> bool:
    """SIGTERM the check's process group (it stops at the next training step)."""
    s = state(run_dir, spec)
    if s["status"] != "running" or not s.get("pid"):
        return False
    try:
        os.killpg(os.getpgid(int(s["pid"])), signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def wait(run_dir, spec, timeout_s: float = 300.0, poll_s: float = 0.5) -> dict:
    end = time.monotonic() + timeout_s
    s = state(run_dir, spec)
    while s["status"] == "running" and time.monotonic() < end:
        time.sleep(poll_s)
        s = state(run_dir, spec)
    return s


def summary_rows(doc: dict) -> list[dict]:
    """One row per removal: what was removed and the loss change (mean ± std, sem) over seeds."""
    k, n = doc["settings"]["top_k"], len(doc["seeds"])
    out = []
    for arm, what in (("top_k", f"top-{k} proponents"), ("random", f"{k} random examples")):
        c = doc["change"][arm]
        out.append(
            {
                "removed": what,
                "loss change (mean)": c["mean"],
                "std": c["std"],
                "sem": c["sem"],
                "per seed": ", ".join(f"{d:+.4f}" for d in c["delta"]),
                "seeds": n,
            }
        )
    return out


# -- per-token view -----------------------------------------------------------------------------
def token_view(run_dir: str | os.PathLike, res, example_id: int):
    """``(pieces, TokenContributions)``: the example's tokens as text pieces and their shares of
    its score against the query of ``res``, in the index ``res`` was ranked with (computed by
    the query worker, or here under the run's query lock)."""
    import dataclasses

    from traceprop_engine.settings import IndexSettings

    names = {f.name for f in dataclasses.fields(IndexSettings)}
    s = {k: v for k, v in res.query.items() if k in names}
    try:
        tc = model_worker.call(
            "token_contributions",
            run_dir,
            sketches=res.sketches,
            example_id=int(example_id),
            settings=s,
        )
    except model_worker.WorkerUnavailable:
        from traceprop_engine.attribution import token_contributions

        run, lock = in_process(run_dir)
        with lock:
            tc = token_contributions(run, res.sketches, int(example_id), IndexSettings(**s))
    ids = tc.token_ids.tolist()
    pieces = token_pieces(run_dir, ids) or [f"[{t}]" for t in ids]
    return pieces, tc


def highlighted_html(pieces: list[str], contributions, loss_mask) -> str:
    """The tokens as HTML spans shaded by contribution (green: toward the output, red: away);
    every piece is HTML-escaped, so no data is ever rendered as markup."""
    vals = [float(c) for c in contributions]
    top = max((abs(v) for v in vals), default=0.0) or 1.0
    spans = []
    for piece, v, m in zip(pieces, vals, loss_mask, strict=True):
        a = min(abs(v) / top, 1.0)
        rgb = "42,157,143" if v >= 0 else "231,111,81"
        bg = f"background:rgba({rgb},{0.08 + 0.8 * a:.2f});" if m else "color:#888;"
        tip = f"{v:+.4g}" if m else "no loss on this token"
        text = html.escape(piece).replace("\n", "↵<br>")
        spans.append(f'<span class="tp-tok" style="{bg}padding:1px 0" title="{tip}">{text}</span>')
    return (
        '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.9">'
        + "".join(spans)
        + "</div>"
    )


def score_line(pieces: list[str], tc) -> str:
    """One line relating the per-token view's numbers: the tokens' contributions sum to the
    example's score on the final model, and the ranking's score is the same measure on the
    gradients recorded during training (read as a contradiction when shown apart)."""
    vals = [(float(v), pieces[i]) for i, v in enumerate(tc.contributions) if tc.loss_mask[i]]
    vals.sort(key=lambda x: -abs(x[0]))
    total = float(tc.contributions.sum())
    kind = "cosine score" if tc.cosine else "score"
    parts = [f"{p!r} {v:+.4f}" for v, p in vals[:1]]
    if len(vals) > 1:
        rest = sum(v for v, _ in vals[1:])
        parts.append(f"{len(vals) - 1} other token{'s' if len(vals) > 2 else ''} {rest:+.4f}")
    line = (
        f"Sum over tokens: {' + '.join(parts) or '0'} = {total:+.4f}, its {kind} on the final model"
    )
    if tc.stored_score is None:
        return line + "."
    rel = f"{tc.stored_score / total:.2f} × that" if abs(total) > 1e-12 else "against 0"
    return (
        f"{line} · ranking {kind} {tc.stored_score:+.4f} ({rel}): the same {kind} on the "
        "example's gradients recorded during training, summed over the steps that saw it."
    )
