"""Test side: the run's final model rebuilt with its tracked layers, and a query's sketches.

A query (text, an example of the run, or token ids) is tokenized as training saw it, its loss
on the final model is backpropagated once with the capture hooks attached to the layers the
store describes, with the store's projections: its sketches live in the space of the stored
training records.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import torch

from ... import constants as C
from ...capture.hooks import Capture
from ...capture.layers import TrackedLayer
from ...errors import ModelMismatchError, QueryError, RunError
from ...run import RunManifest
from ...settings import SketchKind
from ...training.examples import Example
from ...training.fingerprint import cached_model_fingerprint, model_files_key
from ...training.losses import example_losses
from ...training.models import (
    Encoded,
    collate,
    encode_example,
    load_saved_model,
    model_inputs,
    quiet_hf,
)
from ..query_input import Query
from ..query_sketches import QuerySketches


class QueryEncoder:
    """The saved model of one run (loaded on first use) and the test-side sketches taken on it.

    Args:
        run_dir: the run directory (its ``model/`` folder holds the final model).
        manifest: the run's manifest (``config.max_length``).
        store: the run's store (layers, projections, example tokens).
        task: ``causal-lm`` or ``classification``.
        examples: the run's example table (see :meth:`AttributionRun.examples`).
        device: where the model runs.
    """

    def __init__(
        self,
        run_dir: Path,
        manifest: RunManifest,
        store,
        task: str,
        examples: Callable[[], pl.DataFrame],
        device: str = "cpu",
    ) -> None:
        self.run_dir = run_dir
        self.manifest = manifest
        self.store = store
        self.task = task
        self.examples = examples
        self.device = device
        self._loaded = None
        self._layers: list[TrackedLayer] | None = None
        self.model_fingerprint: str | None = None  # of the model loaded (set by model())
        self.model_notes: list[str] = []  # what a query should know about that model

    # -- the model ------------------------------------------------------------------------------
    def model(self):
        """The final model, tokenizer and labels (``LoadedModel``), with the store's layers found
        in it and checked against the store (:meth:`tracked_layers`)."""
        if self._loaded is None:
            model_dir, want = self._model_dir()
            fingerprint, files = self._checked_fingerprint(model_dir, want)
            with quiet_hf():
                loaded = load_saved_model(model_dir, self.device)
            if model_files_key(model_dir) != files:  # replaced while it was being read
                raise self._mismatch("its weight files changed while they were loaded; query again")
            self._layers = self._attach_layers(dict(loaded.model.named_modules()))
            self._loaded, self.model_fingerprint = loaded, fingerprint
        return self._loaded

    def _model_dir(self) -> tuple[Path, str | None]:
        """The saved model's folder and the fingerprint recorded for it: ``model/``, or for a
        run that stopped before saving it, the model of its last checkpoint (with a note)."""
        model_dir = self.run_dir / C.MODEL_DIR
        if model_dir.exists():
            return model_dir, self.manifest.model.fingerprint
        from ...training import checkpoint

        ckpt = None if self.manifest.completed else checkpoint.load(self.run_dir)
        saved = ckpt is not None and (ckpt.folder / checkpoint.MODEL_SUBDIR).is_dir()
        if not saved or not ckpt.meta.get("model_fingerprint"):
            raise RunError(
                f"{self.run_dir} has no saved model ({C.MODEL_DIR}/) and no checkpoint holding "
                "one: the run stopped before saving it, and queries need it. `traceprop train "
                "--resume RUN` finishes a run that has a checkpoint"
            )
        self.model_notes = [
            f"this run stopped before saving its final model: queries use the model of its "
            f"last checkpoint (step {ckpt.step}); records written after that step were made by "
            "later weights"
        ]
        return ckpt.folder / checkpoint.MODEL_SUBDIR, str(ckpt.meta["model_fingerprint"])

    def _checked_fingerprint(self, model_dir: Path, want: str | None) -> tuple[str, tuple]:
        """The fingerprint of the weights about to be loaded, refused unless it is ``want`` (the
        one recorded when the model was saved): scores on another model (a swapped ``model/``,
        changed weights) would be silently wrong. Hashed once per process while the files'
        sizes and times stay the same."""
        fingerprint, files = cached_model_fingerprint(model_dir)
        if want and fingerprint != want:
            raise ModelMismatchError(
                f"the model in {model_dir} is not the one this run saved: its weights hash to "
                f"{fingerprint[:16]}…, {C.MANIFEST_FILE} records {want[:16]}… (another model, or "
                "its files changed since). Scores on it would belong to another model, so no "
                f"query is answered: put the run's own model back (`traceprop verify "
                f"{self.run_dir}` shows what changed)"
            )
        return fingerprint, files

    def tracked_layers(self) -> list[TrackedLayer]:
        """The store's layers on the loaded model, as the query-side capture hooks use them."""
        self.model()
        return self._layers

    def _attach_layers(self, modules: dict) -> list[TrackedLayer]:
        layers = []
        for li, info in enumerate(self.store.layers):
            m = modules.get(info.name)
            if m is None:
                raise self._mismatch(f"the saved model has no layer {info.name!r}")
            m.weight.requires_grad_(True)
            dense = SketchKind(info.sketch) is SketchKind.DENSE
            layer = TrackedLayer.from_stored(
                info,
                m,
                self.store.projection(li, "in"),
                self.store.projection(li, "out"),
                self.store.dense_projection(li) if dense else None,
            )
            w = m.weight
            d_in, d_out = (
                (w.shape[0], w.shape[1])
                if info.kind in ("conv1d", "embedding")
                else (w.shape[1], w.shape[0])
            )
            if (d_in, d_out) != (info.d_in, info.d_out):
                raise self._mismatch(
                    f"layer {info.name} is {d_in}->{d_out} in the model, {info.d_in}->{info.d_out} in the store"
                )
            layers.append(layer)
        return layers

    def _mismatch(self, detail: str) -> ModelMismatchError:
        return ModelMismatchError(
            f"the model in {self.run_dir / C.MODEL_DIR} does not match the store ({detail})"
        )

    # -- tokens ---------------------------------------------------------------------------------
    def encode(self, query: Query):
        """Tokens of ``query`` as training saw them.

        Returns:
            ``(Encoded, query description, notes)``.
        """
        loaded = self.model()
        if query.input_ids is not None:
            enc = self._encode_ids(
                loaded, query.input_ids, query.labels, query.loss_mask, query.label
            )
            return enc, {}, []
        if loaded.tokenizer is None and query.eval_example is None:
            raise QueryError(
                "this run has no tokenizer (it was finished without one): query it by token ids, "
                "run.query(input_ids=..., labels=...)"
            )
        label = query.label
        ignored = (
            [
                f"the label {label!r} was not used: this run is {self.task}, where the "
                "completion (or the text) is what a query explains; --label is for "
                "classification runs"
            ]
            if label is not None and self.task != "classification"
            else []
        )
        if query.eval_example is not None:
            enc, desc = self._encode_example(loaded, query.eval_example)
            return enc, desc, ignored
        enc, desc, notes = self._encode_text(loaded, query.prompt, query.completion, label)
        return enc, desc, ignored + notes

    def _encode_example(self, loaded, eval_example: int) -> tuple[Encoded, dict]:
        """An example of the run, from the tokens the store kept for it."""
        ex = self.examples()
        if not 0 <= eval_example < ex.height:
            raise QueryError(
                f"example {eval_example} does not exist (the run has examples 0..{ex.height - 1})"
            )
        r = ex.row(eval_example, named=True)
        ids, mask = self.store.tokens(eval_example)
        lab = -1
        if self.task == "classification":
            lab = (
                (loaded.labels or []).index(r["label"])
                if r["label"] in (loaded.labels or [])
                else -1
            )
        enc = Encoded(ids.astype(np.int32), mask.astype(np.uint8), lab)
        desc = {
            "eval_example": eval_example,
            "source": r["source"],
            "row": r["row"],
            "prompt": r["prompt"] or r["text"],
            "completion": r["completion"],
            "label": r["label"],
            "split": r["split"],
        }
        return enc, desc

    def _encode_text(self, loaded, prompt, completion, label) -> tuple[Encoded, dict, list[str]]:
        """A text query through the run's tokenizer (classification: a text and its label)."""
        max_length = int(self.manifest.config.get("max_length", 128))
        notes: list[str] = []
        if self.task == "classification":
            if not (prompt or "").strip():
                raise QueryError("the text to classify is empty: type a text")
            labels = loaded.labels or []
            if label is None or label not in labels:
                raise QueryError(f"a classification query needs a label, one of {labels}")
            ex = Example(source="<query>", row=1, sha256="", text=prompt, label=label)
            enc = encode_example(
                ex,
                loaded.tokenizer,
                "classification",
                max_length,
                {lab: i for i, lab in enumerate(labels)},
            )
            return enc, {"prompt": prompt, "label": label}, notes
        if not (prompt or "").strip() and not (completion or "").strip():
            raise QueryError(
                "the prompt is empty: type a prompt (and the completion whose origin you want explained)"
            )
        _check_prompt_and_completion(prompt, completion)
        if completion:
            ex = Example(
                source="<query>", row=1, sha256="", prompt=prompt or "", completion=completion
            )
        else:
            ex = Example(source="<query>", row=1, sha256="", text=prompt)
        enc = encode_example(ex, loaded.tokenizer, "causal-lm", max_length)
        if enc.truncated:
            notes.append(
                f"the query was longer than the model's training length ({max_length} tokens) and was truncated"
            )
        if enc.loss_mask.sum() == 0:
            raise QueryError(
                "the query has no target token to explain: give a completion (or a longer text)"
            )
        return enc, {"prompt": prompt, "completion": completion}, notes

    def _encode_ids(self, loaded, input_ids, labels, loss_mask, label) -> Encoded:
        """An :class:`Encoded` from token ids and ``labels`` (-100: no loss) or a 0/1 loss mask."""
        ids = _as_1d_ints(input_ids, "input_ids")
        if ids.size == 0:
            raise QueryError("input_ids is empty: give the query's token ids")
        vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
        if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
            raise QueryError(
                f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        mask = _loss_mask(ids, labels, loss_mask)
        lab_id = -1
        if self.task == "classification":
            names = loaded.labels or []
            if label not in names:
                raise QueryError(f"a classification query needs a label, one of {names}")
            lab_id = names.index(label)
            mask = np.ones(ids.size, bool)
        elif not mask[1:].any():
            raise QueryError(
                "the query has no target token (labels all -100, or only the first token): mark "
                "the tokens whose loss you want explained"
            )
        return Encoded(ids.astype(np.int32), mask.astype(np.uint8), lab_id)

    # -- sketches -------------------------------------------------------------------------------
    def query_sketches(self, enc) -> tuple[QuerySketches, float]:
        """Per-layer ``(1, *record_shape)`` sketches of the query's loss on the final model, with
        each factored layer's per-token factors (:class:`QuerySketches`)."""
        loaded = self.model()
        layers = self._layers
        batch = collate([enc], pad_id(loaded), self.task, self.device)
        slots = [
            torch.zeros(1, *(info.record_shape), device=self.device) for info in self.store.layers
        ]
        with (
            torch.enable_grad(),
            Capture(loaded.model, layers, covariance=False) as cap,
            cap.batch(slots, token_mask=batch["attention_mask"], loss_scale=1.0),
        ):
            cap.token_factors = [[] for _ in layers]
            loss = example_losses(loaded.model(**model_inputs(batch)), batch, self.task)
            loss.sum().backward()
        loaded.model.zero_grad(set_to_none=True)
        factors = [
            _token_factors(parts, info) if info.sketch == "factored" else None
            for parts, info in zip(cap.token_factors, self.store.layers, strict=True)
        ]
        names = loaded.labels or []
        label = (
            names[enc.label]
            if self.task == "classification" and 0 <= enc.label < len(names)
            else None
        )
        return (
            QuerySketches([s.cpu().numpy() for s in slots], factors, label),
            float(loss.detach()[0]),
        )

    @torch.no_grad()
    def representations(self, encs) -> np.ndarray:
        """Mean-pooled final hidden state of each encoded example (representation-similarity baseline)."""
        loaded = self.model()
        pad = pad_id(loaded)
        out = []
        for i in range(0, len(encs), 16):
            batch = collate(encs[i : i + 16], pad, self.task, self.device)
            h = loaded.model(**model_inputs(batch), output_hidden_states=True).hidden_states[-1]
            m = batch["attention_mask"].unsqueeze(-1).float()
            out.append(((h * m).sum(1) / m.sum(1)).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _token_factors(parts: list, info) -> tuple[np.ndarray, np.ndarray]:
    """``(A, B)`` ``(k_out, t)``, ``(k_in, t)`` float32 of one layer's query sketch ``A Bᵀ`` from
    the capture's per-use ``(g (1, T, k_out), a (1, T, k_in))``: one column per token, those whose
    gradient or input is zero (padding, tokens after the last loss token) left out."""
    a_cols = [torch.zeros(info.k_out, 0)]
    b_cols = [torch.zeros(info.k_in, 0)]
    for g, a in parts:
        g, a = g[0].float().cpu(), a[0].float().cpu()  # (T, k_out), (T, k_in)
        live = g.abs().amax(1).gt(0) & a.abs().amax(1).gt(0)
        a_cols.append(g[live].T)
        b_cols.append(a[live].T)
    return torch.cat(a_cols, 1).numpy(), torch.cat(b_cols, 1).numpy()


def _check_prompt_and_completion(prompt: str | None, completion: str | None) -> None:
    """Refuse the two text queries that looked answered but explained something else: an empty
    completion (it read as a whole-text query of the prompt: the loss on every prompt token but
    the first) and a completion with no prompt (its first token has nothing to be predicted
    from: a one-word completion explained only the end-of-text token). A whole-text query
    passes no completion at all (``completion=None``)."""
    if completion is not None and not completion.strip():
        raise QueryError(
            "the completion is empty: type the completion whose origin you want explained (to "
            "explain every token of a text instead, give it as the prompt and no completion)"
        )
    if completion is not None and not (prompt or "").strip():
        raise QueryError(
            "the prompt is empty: type the prompt the completion follows (with no prompt, the "
            "completion's first token has nothing to be predicted from and the query would "
            "explain only the tokens after it)"
        )


def pad_id(loaded) -> int:
    """The pad id: the tokenizer's, else the model config's, else 0 (right padding is masked)."""
    tok = loaded.tokenizer
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    pad = getattr(getattr(loaded.model, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _loss_mask(ids: np.ndarray, labels, loss_mask) -> np.ndarray:
    """Which tokens take a loss: ``labels != -100`` (equal to the ids there), a 0/1 mask, or all."""
    if labels is not None and loss_mask is not None:
        raise QueryError("give labels or loss_mask, not both")
    if labels is not None:
        lab = _as_1d_ints(labels, "labels")
        if lab.shape != ids.shape:
            raise QueryError(
                f"labels has {lab.size} entries, input_ids {ids.size}: give one per token"
            )
        mask = lab != -100
        if np.any(lab[mask] != ids[mask]):
            raise QueryError(
                "labels must equal input_ids where a loss is taken (-100 elsewhere), as for a "
                "Hugging Face causal LM (the model shifts them)"
            )
        return mask
    if loss_mask is not None:
        mask = _as_1d_ints(loss_mask, "loss_mask")
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise QueryError("loss_mask must hold one 0/1 value per token of input_ids")
        return mask.astype(bool)
    return np.ones(ids.size, bool)


def _as_1d_ints(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise QueryError(
            f"{what} must be a 1-D sequence of integers, got {a.dtype} of shape {a.shape}"
        )
    return a.astype(np.int64)
