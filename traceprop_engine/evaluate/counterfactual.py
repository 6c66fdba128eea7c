"""The counterfactual check of one query: retrain without its top-k proponents, and without k
random examples as a control, and measure how the query's loss changes.

The check the attribution literature recommends before trusting a ranking: if the examples the
ranking calls proponents really support the query's completion, a model retrained without them
should find the completion harder (its loss rises) — more so than one retrained without as
many random examples.

Protocol, per seed ``r`` of ``seeds`` (training seed ``config.seed + r · RETRAIN_SEED_STRIDE``;
``r = 0`` is the run's own seed):

* ``full``:   retrain on every training example of the run (the baseline of that seed);
* ``top_k``:  retrain without the query's ``k`` top proponents (the run's ranking);
* ``random``: retrain without ``k`` examples drawn at random (``default_rng([seed, r])``)
  from the examples that are not top-k proponents.

Every retrain uses the run's recipe (``run.json``'s ``config``, untracked) from one shared
initial model (``base_model/``; the tiny model's tokenizer is otherwise trained on the data,
and a subset would get another vocabulary). The reported change of an arm is, per seed,
``loss(arm) - loss(full)`` of the query (mean token cross-entropy of its completion), then the
mean, the standard deviation and the standard error over the seeds.

Files, in the check's results folder (``RUN/counterfactual/`` by default; ``out`` elsewhere: a
bundled or read-only run is never written to, the app puts its checks beside the user's runs):
``<key>.json`` (the result, written atomically), ``<key>.progress.json`` (what is running, for
the app), ``<key>.log`` (the app's log of the job), ``<key>.work/`` while retraining.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import constants as C
from ..errors import ConfigError, QueryError, RunError
from ..run import RunManifest
from .lds_retrain import record
from .lds_settings import RETRAIN_SEED_STRIDE, atomic_write_text

CF_DIR = "counterfactual"
ARMS = ("full", "top_k", "random")
# a run is "small enough to retrain" when the whole check is estimated to take at most this long
MAX_ESTIMATED_S = 900.0
MAX_SEEDS = 10

ProgressFn = Callable[[int, int, str], None]


class Cancelled(RunError):
    """The counterfactual check was stopped (SIGTERM / a stop request) before it finished."""


@dataclass(frozen=True)
class CounterfactualSpec:
    """One counterfactual check: the query, how many proponents to remove, how many seeds."""

    prompt: str
    completion: str
    top_k: int = 10
    seeds: int = 3
    preconditioner: str = C.DEFAULT_PRECONDITIONER

    def __post_init__(self) -> None:
        if not (self.prompt or "").strip() and not (self.completion or "").strip():
            raise QueryError(
                "the counterfactual check needs a query: give a prompt and a completion"
            )
        if not 1 <= self.seeds <= MAX_SEEDS:
            raise ConfigError(f"the seeds (--seeds) must be 1..{MAX_SEEDS}, got {self.seeds}")
        if self.top_k < 1:
            raise ConfigError(
                f"the proponents to remove (k, --top-k) must be at least 1, got {self.top_k}"
            )

    def key(self) -> str:
        """The file name of this check's result (a hash of the query and the settings)."""
        doc = json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]


Out = str | os.PathLike | None
"""A check's results folder; None: ``RUN/counterfactual``."""


def results_dir(run_dir: str | os.PathLike, out: Out = None) -> Path:
    """The folder of a run's check results: ``out``, or ``RUN/counterfactual`` by default."""
    return Path(out) if out is not None else Path(run_dir) / CF_DIR


def result_path(run_dir: str | os.PathLike, spec: CounterfactualSpec, out: Out = None) -> Path:
    return results_dir(run_dir, out) / f"{spec.key()}.json"


def progress_path(run_dir: str | os.PathLike, spec: CounterfactualSpec, out: Out = None) -> Path:
    return results_dir(run_dir, out) / f"{spec.key()}.progress.json"


def load_result(
    run_dir: str | os.PathLike, spec: CounterfactualSpec, out: Out = None
) -> dict | None:
    """The saved result of this check on this run, or None when it was never completed."""
    p = result_path(run_dir, spec, out)
    return json.loads(p.read_text()) if p.exists() else None


def check_writable(run_dir: str | os.PathLike, out: Out = None) -> Path:
    """The results folder, made if missing.

    Raises:
        RunError: it cannot be written (a read-only run with no ``out``): nothing is retrained.
    """
    d = results_dir(run_dir, out)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise RunError(
            f"cannot write the counterfactual check's results to {d}: {e.strerror or e}"
            + ("; the run is read-only: give another folder (--out DIR)" if out is None else "")
        ) from e
    return d


def max_top_k(n_train: int) -> int:
    """The most proponents a check can remove: half the training examples (the control removes
    as many others)."""
    return max(0, int(n_train) // 2)


def plan(run_dir: str | os.PathLike, spec: CounterfactualSpec) -> dict:
    """What the check would retrain and an estimate of its time; refuses runs too big to retrain.

    Raises:
        RunError: the run is not complete, or its training time says the check would take
            longer than :data:`MAX_ESTIMATED_S`.
        ConfigError: top-k leaves no training example, or the random arm has nothing to draw.
    """
    m = RunManifest.load(run_dir)
    if not m.completed:
        raise RunError(
            f"{run_dir} is not a completed run (status {m.status!r}); nothing to retrain"
        )
    n_train = int(m.data.n_train or 0)
    if spec.top_k > max_top_k(n_train):
        raise ConfigError(
            f"removing {spec.top_k} proponents (k, --top-k) is too many for {n_train} training "
            f"examples: the control removes k other examples, so k can be at most "
            f"{max_top_k(n_train)}"
        )
    per_retrain = float(m.timings.total_s or 0.0) + 3.0  # + model build / load / save
    n_retrains = len(ARMS) * spec.seeds
    est = per_retrain * n_retrains
    if est > MAX_ESTIMATED_S:
        raise RunError(
            f"this run is too big for the counterfactual check: {n_retrains} retrains of about "
            f"{per_retrain:.0f} s each (~{est:.0f} s, the limit is {MAX_ESTIMATED_S:.0f} s); "
            "use fewer seeds or a smaller run"
        )
    return {"n_train": n_train, "retrains": n_retrains, "estimated_s": round(est, 1)}


def _train_settings(m: RunManifest):
    from ..settings import TrainSettings

    names = {f.name for f in dataclasses.fields(TrainSettings)}
    cfg = {k: v for k, v in m.config.items() if k in names}
    cfg.update(track=None, eval_data=None, eval_fraction=0.0, device="cpu", threads=1)
    return TrainSettings(**cfg)


def _base_model(run_dir: Path, settings, rows: list[dict], out: Path) -> str:
    """The shared initial model: the tiny model rebuilt as the run built it (its tokenizer
    checked against the run's), or the run's own starting model when it was a local one."""
    from ..training.data import Example
    from ..training.models import TINY, build_model, load_saved_model, save_model

    if settings.model != TINY:
        return settings.model
    texts = [
        Example(source="", row=0, sha256="", **{k: r[k] for k in r if k != "label"}).full_text()
        for r in rows
    ]
    loaded = build_model(
        TINY,
        settings.task.value,
        texts,
        seed=settings.seed,
        tiny_vocab=settings.tiny_vocab,
        tiny_width=settings.tiny_width,
        tiny_layers=settings.tiny_layers,
        max_length=settings.max_length,
    )
    run_tok = load_saved_model(run_dir / C.MODEL_DIR).tokenizer
    if run_tok is not None and run_tok.get_vocab() != loaded.tokenizer.get_vocab():
        raise RunError(
            "the tiny model's tokenizer rebuilt from the run's examples differs from the run's: "
            "cannot retrain with the same recipe"
        )
    save_model(loaded, out)
    return str(out.resolve())


def _query_loss(model_dir: Path, spec: CounterfactualSpec, task: str, max_length: int) -> float:
    import torch

    from ..training.data import Example
    from ..training.losses import example_losses
    from ..training.models import collate, encode_example, load_saved_model, model_inputs

    loaded = load_saved_model(model_dir, "cpu")
    if spec.completion:
        ex = Example(
            source="<query>", row=1, sha256="", prompt=spec.prompt, completion=spec.completion
        )
    else:  # a text query (an eval example of a text data set): the loss on all its tokens
        ex = Example(source="<query>", row=1, sha256="", text=spec.prompt)
    enc = encode_example(ex, loaded.tokenizer, task, max_length)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    batch = collate([enc], pad, task, "cpu")
    with torch.no_grad():
        return float(example_losses(loaded.model(**model_inputs(batch)), batch, task)[0])


def _retrain(settings, rows: list[dict], work: Path, seed: int, stop) -> Path:
    from ..training.loop import train

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    rs = dataclasses.replace(settings, data=str(data), out=str(work / "run"), seed=seed)
    run_dir = train(rs, overwrite=True, stop=stop)
    status = RunManifest.load(run_dir).status
    if status == C.STATUS_CANCELLED:
        raise Cancelled("the counterfactual check was cancelled")
    if status != C.STATUS_COMPLETED:
        raise RunError(f"a retrain ended {status!r}; see {run_dir}")
    return run_dir


def summarize(losses: dict[str, list[float]]) -> dict:
    """Per arm: the per-seed change ``loss(arm) - loss(full)``, its mean, std and standard error."""
    full = np.asarray(losses["full"], dtype=np.float64)
    out = {}
    for arm in ("top_k", "random"):
        d = np.asarray(losses[arm], dtype=np.float64) - full
        n = len(d)
        std = float(d.std(ddof=1)) if n > 1 else None  # one seed: no spread to report
        out[arm] = {
            "delta": [float(x) for x in d],
            "mean": float(d.mean()),
            "std": std,
            "sem": std / float(np.sqrt(n)) if std is not None else None,
        }
    out["top_k_minus_random"] = out["top_k"]["mean"] - out["random"]["mean"]
    return out


# long: one sequential protocol (rank, base model, retrain arms per seed, summary, save)
def run_counterfactual(
    run_dir: str | os.PathLike,
    spec: CounterfactualSpec,
    progress: ProgressFn | None = None,
    stop=None,
    out: Out = None,
) -> dict:
    """Run the counterfactual check of ``spec`` on ``run_dir`` and save its result.

    Args:
        out: the results folder (default ``RUN/counterfactual``); nothing is written into the
            run when it is given.
        progress: called as ``progress(done, total, message)`` after each step.
        stop: a :class:`~traceprop_engine.training.loop.StopFlag`; SIGTERM sets it (in the main
            thread) and the check stops at the next training step, raising :class:`Cancelled`.

    Returns:
        The result document (also written to :func:`result_path`).
    """
    from ..attribution import open_run
    from ..settings import IndexSettings
    from ..training.loop import StopFlag

    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    info = plan(run_dir, spec)
    cf = check_writable(run_dir, out)  # before the work, not after it
    os.environ.setdefault("TQDM_DISABLE", "1")
    stop = stop or StopFlag()
    m = RunManifest.load(run_dir)
    settings = _train_settings(m)
    task = settings.task.value
    total = 1 + len(ARMS) * spec.seeds
    say = progress or (lambda done, total, msg: None)

    run = open_run(run_dir)
    try:
        res = run.query(
            spec.prompt,
            spec.completion or None,  # "": a text query (an eval example of a text data set)
            top_k=spec.top_k,
            settings=IndexSettings(preconditioner=spec.preconditioner),
        )
        ex = run.examples()
    finally:
        run.close()
    train_rows = ex.filter(ex["split"] == C.SPLIT_TRAIN)
    ids = train_rows["example_id"].to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise RunError("the run's training examples are not examples 0..n_train-1")
    rows = [record(r, task) for r in train_rows.iter_rows(named=True)]
    props = res.proponents.sort("score", descending=True)
    top = [int(i) for i in props["example_id"].to_list()[: spec.top_k]]
    if len(top) < spec.top_k:
        raise QueryError(
            f"the query has only {len(top)} proponents (positive scores); use --top-k {len(top)} or less"
        )
    work = cf / f"{spec.key()}.work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        base = _base_model(run_dir, settings, rows, work / "base_model")
        settings = dataclasses.replace(settings, model=base)
        original = _query_loss(run_dir / C.MODEL_DIR, spec, task, settings.max_length)
        say(1, total, "ranked the query and built the initial model")
        losses: dict[str, list[float]] = {a: [] for a in ARMS}
        removed_random: list[list[int]] = []
        pool = np.setdiff1d(np.arange(len(rows)), top)
        done = 1
        for r in range(spec.seeds):
            seed = settings.seed + RETRAIN_SEED_STRIDE * r
            rnd = sorted(
                int(i)
                for i in np.random.default_rng([settings.seed, r]).choice(
                    pool, size=spec.top_k, replace=False
                )
            )
            removed_random.append(rnd)
            drop = {"full": set(), "top_k": set(top), "random": set(rnd)}
            for arm in ARMS:
                if stop.requested:
                    raise Cancelled("the counterfactual check was cancelled")
                kept = [row for i, row in enumerate(rows) if i not in drop[arm]]
                run = _retrain(settings, kept, work / f"{arm}_{r}", seed, stop)  # not `out`
                losses[arm].append(_query_loss(run / C.MODEL_DIR, spec, task, settings.max_length))
                shutil.rmtree(run.parent, ignore_errors=True)
                done += 1
                say(
                    done,
                    total,
                    f"seed {r + 1}/{spec.seeds}: retrained {arm} "
                    f"(query loss {losses[arm][-1]:.4f})",
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "run_id": m.run_id,
        "query": {"prompt": spec.prompt, "completion": spec.completion},
        "settings": dataclasses.asdict(spec),
        "key": spec.key(),
        "n_train": info["n_train"],
        "original_loss": original,
        "removed": {
            "top_k": top,
            "top_k_scores": [float(s) for s in props["score"].to_list()[: spec.top_k]],
            "random": removed_random,
        },
        "seeds": [settings.seed + RETRAIN_SEED_STRIDE * r for r in range(spec.seeds)],
        "losses": losses,
        "change": summarize(losses),
        "what": "change = query loss of the model retrained without the removed examples minus "
        "that of the model retrained on all of them, same recipe and seed; mean, std and "
        "standard error over seeds",
        "seconds": round(time.perf_counter() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    cf.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_path(run_dir, spec, out), json.dumps(doc, indent=1))
    return doc


# -- a check run as a background job (the CLI writes the progress file, the app reads it) ----------
def _write_progress(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({**doc, "updated": time.time()}))


def run_with_progress_file(
    run_dir: str | os.PathLike, spec: CounterfactualSpec, out: Out = None
) -> dict:
    """:func:`run_counterfactual` recording its state in :func:`progress_path` (status running,
    completed, cancelled or failed; done/total; the last message; the error)."""
    from ..training.loop import StopFlag

    plan(run_dir, spec)  # a check refused up front leaves no progress file behind
    check_writable(run_dir, out)
    path = progress_path(run_dir, spec, out)
    state = {"pid": os.getpid(), "status": "running", "done": 0, "total": 0, "message": "starting"}
    _write_progress(path, state)

    def progress(done: int, total: int, message: str) -> None:
        state.update(done=done, total=total, message=message)
        _write_progress(path, state)

    stop = StopFlag()
    old = signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "requested", True))
    try:
        doc = run_counterfactual(run_dir, spec, progress=progress, stop=stop, out=out)
    except Cancelled as e:
        _write_progress(path, {**state, "status": "cancelled", "error": str(e)})
        raise
    except BaseException as e:
        _write_progress(path, {**state, "status": "failed", "error": str(e) or type(e).__name__})
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
    _write_progress(path, {**state, "status": "completed"})
    return doc


def job_state(run_dir: str | os.PathLike, spec: CounterfactualSpec, out: Out = None) -> dict:
    """The check's state: ``status`` one of none, running, completed, cancelled, failed (a
    process that vanished without saying so reads as failed), with done/total/message/error.
    A running check reads as running even when an older result is saved."""
    from ..run import pid_alive

    st: dict = {"status": "none", "done": 0, "total": 0, "message": "", "error": ""}
    p = progress_path(run_dir, spec, out)
    if p.exists():
        try:
            st.update(json.loads(p.read_text()))
        except json.JSONDecodeError:
            st.update(status="running", message="starting")
        pid = int(st.get("pid") or 0)
        if st["status"] == "running" and not (pid > 0 and pid_alive(pid)):
            st.update(status="failed", error=st.get("error") or "the counterfactual process exited")
    if st["status"] != "running" and result_path(run_dir, spec, out).exists():
        st.update(status="completed", error="")
    return st
