"""K-FAC statistics fitted on the final model (``IndexSettings.statistics`` = ``final`` / ``both``).

The inline statistics (:mod:`traceprop_engine.capture.hooks`) are summed over every stride-th
batch of the whole trajectory. On a pretrained causal LM fine-tuned in full, whitened at the
Fisher's own scale (``weighting='fisher'``), they lost up to 0.05 LDS against the same statistics
of the final model, and the mean of the two was the best of the three on the mean over four
(set, seed) pairs (benchmarks/EVAL.md §1q). This module fits the final model's: one forward and
backward pass over up to :data:`FINAL_EXAMPLES` of the run's trained examples (their stored
tokens, the training labels: the empirical Fisher, like the inline ones), through the run's own
tracked layers and projections, so ``A = Σ ã ãᵀ`` and ``S = Σ g̃ g̃ᵀ`` are in the records' space.
They are cached in ``final-statistics.npz`` beside the run's indexes, keyed by the store's and
the model's fingerprints, so a run pays the pass once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ... import constants as C
from ...errors import StoreError
from ...store.format import Covariance

FINAL_EXAMPLES = 1024
"""At most this many trained examples (evenly spaced over their ids) fit the final model's
statistics: all of them on the evaluation sets (180–240), a fixed cost on a large run."""
BATCH = 8
CACHE_FILE = "final-statistics.npz"
CACHE_FORMAT = 1


def statistics_examples(store, limit: int = FINAL_EXAMPLES) -> np.ndarray:
    """The trained examples (those with records) that fit the statistics, at most ``limit``,
    evenly spaced over the example ids."""
    ids = np.unique(np.asarray(store.records()[C.REC_EXAMPLE]))
    if len(ids) > limit:
        ids = ids[np.linspace(0, len(ids) - 1, limit).round().astype(np.int64)]
    return ids


def fit_final_statistics(
    run, progress: Callable[[int, int], None] | None = None, limit: int = FINAL_EXAMPLES
) -> list[Covariance | None]:
    """Per stored layer, the K-FAC statistics of the run's final model over
    :func:`statistics_examples` (None for a layer without any: dense sketches).

    Raises:
        StoreError: the store keeps no example tokens to fit on.
    """
    import torch

    from ...capture.hooks import Capture
    from ...training.losses import example_losses
    from ...training.models import model_inputs

    if not run.store.n_examples:
        raise StoreError(
            f"{run.store.path} keeps no example tokens, so K-FAC statistics cannot be fitted on "
            "the final model: use --statistics inline"
        )
    loaded = run.model()  # checked against the store and the run's recorded fingerprint
    # fresh copies of the query side's layers: their own running sums, the same projections
    layers = [
        dataclasses.replace(x, A=None, S=None, a_tokens=None, a_rows=0, _stack=[], _fired=False)
        for x in run.tracked_layers()
    ]
    ids = statistics_examples(run.store, limit)
    device = run.encoder.device
    shapes = [info.record_shape for info in run.store.layers]
    with torch.enable_grad(), Capture(loaded.model, layers, covariance=True) as cap:
        for done, batch in stored_batches(run, loaded, ids):
            b = len(batch["input_ids"])
            slots = [torch.zeros(b, *shape, device=device) for shape in shapes]
            # loss_scale = B with the mean loss: per-example gradients, as in training
            with cap.batch(slots, token_mask=batch["attention_mask"], loss_scale=b):
                out = loaded.model(**model_inputs(batch))
                example_losses(out, batch, run.task).mean().backward()
            loaded.model.zero_grad(set_to_none=True)
            if progress:
                progress(done, len(ids))
        return cap.covariance_arrays()


def stored_batches(run, loaded, ids: np.ndarray):
    """``(examples done, batch)`` over the stored examples ``ids``, :data:`BATCH` at a time,
    collated on the query side's device (their tokens and loss masks as trained on)."""
    from ...training.models import collate
    from .encode import pad_id

    for lo in range(0, len(ids), BATCH):
        encs = [run.encode(eval_example=int(i))[0] for i in ids[lo : lo + BATCH]]
        yield lo + len(encs), collate(encs, pad_id(loaded), run.task, run.encoder.device)


def mean_statistics(
    inline: Sequence[Covariance | None], final: Sequence[Covariance | None]
) -> list[Covariance | None]:
    """Per layer the mean of the two statistics' per-token means, at the inline token count
    (None where either is missing)."""
    out: list[Covariance | None] = []
    for a, b in zip(inline, final, strict=True):
        if a is None or b is None or not a.n_tokens or not b.n_tokens:
            out.append(None)
            continue
        n = a.n_tokens
        out.append(
            Covariance(
                A=(a.A / n + b.A / b.n_tokens) * (n / 2),
                S=(a.S / n + b.S / b.n_tokens) * (n / 2),
                n_tokens=n,
            )
        )
    return out


def cache_key(run, limit: int = FINAL_EXAMPLES) -> dict:
    """What the cached statistics were fitted from: the store, the model, the examples."""
    # the fingerprint run.json records for the model (every load is checked against it), so a
    # process that never loads the model (the app's) reads statistics a query worker cached
    model = run.manifest.model.fingerprint
    if model is None:  # a run that stopped before saving it: its checkpoint's model
        run.model()
        model = run.encoder.model_fingerprint
    return {
        "format": CACHE_FORMAT,
        "store": run.store.fingerprint,
        "model": model,
        "examples": int(limit),
        "batch": BATCH,
    }


def load_keyed(path: Path, key: dict) -> dict[str, np.ndarray] | None:
    """The arrays of the ``.npz`` at ``path`` written under ``key`` (:func:`save_keyed`); None
    when absent, stale or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if json.loads(str(z["key"])) != key:
                return None
            return {name: z[name] for name in z.files if name != "key"}
    except (OSError, ValueError, KeyError):
        return None


def save_keyed(path: Path, key: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` under ``key`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, key=np.array(json.dumps(key, sort_keys=True)), **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_cached(path: Path, key: dict, n_layers: int) -> list[Covariance | None] | None:
    """The statistics cached at ``path`` for ``key``; None when absent, stale or unreadable."""
    z = load_keyed(path, key)
    if z is None:
        return None
    try:
        return [
            Covariance(A=z[f"A{li}"], S=z[f"S{li}"], n_tokens=float(z[f"n{li}"]))
            if f"A{li}" in z
            else None
            for li in range(n_layers)
        ]
    except KeyError:
        return None


def save_cached(path: Path, key: dict, covs: Sequence[Covariance | None]) -> None:
    """Write ``covs`` under ``key`` atomically (:func:`save_keyed`)."""
    arrays: dict[str, np.ndarray] = {}
    for li, c in enumerate(covs):
        if c is not None:
            arrays[f"A{li}"], arrays[f"S{li}"] = c.A, c.S
            arrays[f"n{li}"] = np.array(c.n_tokens)
    save_keyed(path, key, arrays)


def final_statistics(
    run, root: Path, progress: Callable[[int, int], None] | None = None
) -> list[Covariance | None]:
    """The final model's statistics from ``root/final-statistics.npz`` when it holds them for
    this store and model, else fitted (:func:`fit_final_statistics`) and cached there (a root
    that cannot be written only loses the cache)."""
    key = cache_key(run)
    path = root / CACHE_FILE
    got = load_cached(path, key, len(run.store.layers))
    if got is not None:
        return got
    covs = fit_final_statistics(run, progress)
    with contextlib.suppress(OSError):  # a read-only run: the next build fits them again
        save_cached(path, key, covs)
    return covs


HEAD_EXAMPLES = 256
"""Stored examples (evenly spaced) the LM-bias term's head moment is fitted on: a diagonal of
``k_out`` numbers, which a few thousand tokens fix (all of them on the evaluation sets)."""
HEAD_CACHE_FILE = "head-moment.npz"


def fit_head_moment(run, li: int, limit: int = HEAD_EXAMPLES) -> np.ndarray:
    """The diagonal of the final model's K-FAC output factor of the LM head ``li`` (store
    layer): ``Σ_t (P_out g_t)²`` over the loss tokens of :func:`statistics_examples`, ``g_t =
    (p_t − e_{y_t}) / n`` with ``n`` the example's loss tokens (a per-example mean loss, as the
    inline and final statistics take it). One forward pass, no backward: the head's output
    gradient is the softmax's, so the other layers are not needed (the LM-bias term,
    ``score/lm_bias.py``).

    Raises:
        StoreError: the store keeps no example tokens to fit on.
    """
    import torch

    from ...training.models import model_inputs

    if not run.store.n_examples:
        raise StoreError(f"{run.store.path} keeps no example tokens to fit the LM head's moment on")
    loaded = run.model()
    device = run.encoder.device
    proj = run.store.projection(li, "out")  # (k_out, V), or None: k_out = V, not projected
    p = None if proj is None else torch.as_tensor(proj, device=device)
    out = torch.zeros(run.store.layers[li].k_out, dtype=torch.float64, device=device)
    with torch.no_grad():
        for _, batch in stored_batches(run, loaded, statistics_examples(run.store, limit)):
            logits = loaded.model(**model_inputs(batch)).logits[:, :-1].float()
            target = batch["labels"][:, 1:]
            keep = target != -100
            n = keep.sum(1, keepdim=True).clamp(min=1).expand_as(target)[keep]  # (N,)
            g = torch.softmax(logits[keep], -1)  # (N, V)
            g[torch.arange(len(g), device=device), target[keep]] -= 1.0
            g = g / n[:, None].float()
            out += (g if p is None else g @ p.T).double().pow(2).sum(0)
    return out.cpu().numpy()


def head_moment(run, li: int, root: Path) -> np.ndarray:
    """:func:`fit_head_moment` from ``root/head-moment.npz`` when it holds it for this store,
    model and layer, else fitted and cached there (a root that cannot be written only loses the
    cache)."""
    key = {**cache_key(run, HEAD_EXAMPLES), "layer": int(li)}
    path = root / HEAD_CACHE_FILE
    got = load_keyed(path, key)
    if got is not None and "diag" in got:
        return np.asarray(got["diag"], np.float64)
    diag = fit_head_moment(run, li)
    with contextlib.suppress(OSError):  # a read-only run: the next process fits it again
        save_keyed(path, key, {"diag": diag})
    return diag
