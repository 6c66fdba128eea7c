"""Plain helpers shared by the tests: tiny models, their batches, the per-example autograd
reference, and a tiny fast training configuration on generated data.

They live here, not in ``conftest.py``: test modules import them by name (``from helpers
import ...``, ``tests`` is on the path), and a ``conftest`` module cannot be imported by name
reliably (``tests/app/conftest.py`` is another module named ``conftest``, and pytest swaps
them in ``sys.modules`` while collecting). ``conftest.py`` holds the fixtures built on these.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
)

from traceprop_engine import Store, Tracker
from traceprop_engine import constants as C
from traceprop_engine.capture.layers import build_layers
from traceprop_engine.samples.data import generate_sample_data
from traceprop_engine.settings import TrackSettings, TrainSettings
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import tiny_config

# -- a tiny training run on generated data -------------------------------------------------------
FAST = dict(
    epochs=1, batch_size=8, max_length=48, tiny_layers=1, tiny_width=32, tiny_vocab=300, threads=1
)


def train_classifier_run(root: Path, labels: Sequence[str], lora_rank: int = 0) -> Path:
    """The shipped MiniLM classifier fine-tuned in full (with ``lora_rank``: peft LoRA adapters
    of that rank) and tracked by the engine (``train``) on short texts of ``labels`` (8 training
    and 2 eval rows each, lineage with labels): a classification run to query, in ``root/run``."""
    import json

    from traceprop_engine.training.loop import train

    words = ["red apple cherry", "blue sea sky", "green leaf moss", "white snow cloud"]
    for split, n in (("train", 8), ("eval", 2)):
        (root / split).mkdir()
        rows = [
            {"text": f"{w} {i} {w.split()[i % 3]}", "label": lab}
            for i in range(n)
            for lab, w in zip(labels, words, strict=False)
        ]
        (root / split / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "run"
    train(
        TrainSettings(
            data=str(root / "train"),
            eval_data=str(root / "eval"),
            out=str(out),
            model="minilm",
            task="classification",
            epochs=1,
            batch_size=4,
            max_length=16,
            threads=1,
            lora_rank=lora_rank,
            track=TrackSettings(k_in=4, k_out=4),
        )
    )
    return out


def facts_data(root: Path) -> Path:
    generate_sample_data(root, seed=0, n_entities=8)
    return root


FREE_TEXT_WORDS = [
    "the",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "this",
    "row",
    "as",
    "a",
    "target",
    "of",
    "the",
    "loss",
]


def free_text_data(root: Path) -> Path:
    """``root/train`` (12 rows) and ``root/eval`` (2 rows) of ``{"text"}`` rows of 28 words:
    every token a target, more than 16 an example (free text, ``TrackSettings.free_text_rank``)."""
    import json

    for part, n in (("train", 12), ("eval", 2)):
        (root / part).mkdir(parents=True)
        w = FREE_TEXT_WORDS
        rows = [{"text": " ".join(w[i % 5 :] * 2 + w[: i % 5])} for i in range(n)]
        (root / part / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def fast_settings(data: Path, out: Path, **kw) -> TrainSettings:
    track = kw.pop("track", TrackSettings(k_in=4, k_out=4))
    return TrainSettings(
        data=str(data / "train"),
        eval_data=str(data / "eval"),
        out=str(out),
        track=track,
        **{**FAST, **kw},
    )


# -- tiny models -----------------------------------------------------------------------------------
VOCAB = 97
"""Vocabulary of the tiny models and of :func:`causal_batch`'s random tokens."""


def tiny_neox() -> torch.nn.Module:
    """GPT-NeoX, 2 blocks × width 32 (Linear layers), no dropout, eval mode, seeded."""
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        rotary_pct=0.25,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTNeoXForCausalLM(cfg).eval()


def tiny_neox_lora(targets: tuple[str, ...] = ("query_key_value", "dense")) -> torch.nn.Module:
    """:func:`tiny_neox` with peft LoRA adapters (r = 4, alpha 8, no dropout) on ``targets``,
    A and B both random (``init_lora_weights=False``): both sides carry a gradient."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=list(targets),
        init_lora_weights=False,
    )
    return get_peft_model(tiny_neox(), cfg)


def tiny_gpt2(
    vocab: int = VOCAB, *, layers: int = 2, heads: int = 4, pad_token_id: int | None = None
) -> torch.nn.Module:
    """GPT-2 (Conv1D layers), width 32, no dropout, eval mode, seeded."""
    torch.manual_seed(1)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=layers,
        n_head=heads,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=pad_token_id,
    )
    return GPT2LMHeadModel(cfg).eval()


def tiny_bert_classifier() -> torch.nn.Module:
    """BERT with a 3-class head, 2 blocks × width 32, no dropout, eval mode, seeded."""
    torch.manual_seed(2)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg).eval()


def engine_neox(
    vocab: int, *, width: int = 32, layers: int = 1, seed: int = 0, pad_token_id: int | None = None
) -> torch.nn.Module:
    """The engine's own ``tiny`` architecture (``tiny_config``, what ``traceprop train`` builds)."""
    cfg = tiny_config(vocab, width=width, layers=layers)
    if pad_token_id is not None:
        cfg.pad_token_id = pad_token_id
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(cfg)


def causal_batch(seed: int = 0):
    """Three examples of different lengths, right-padded, loss on the completion only.

    Returns:
        ``ids``, ``mask`` (padding mask), ``labels`` (-100 off the loss), ``lengths``.
    """
    g = torch.Generator().manual_seed(seed)
    lengths, prompt_lens = [11, 7, 9], [4, 3, 0]
    T = max(lengths)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    labels = torch.full((3, T), -100)
    for b, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True)):
        ids[b, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, :n] = 1
        labels[b, p:n] = ids[b, p:n]
    return ids, mask, labels, lengths


# -- the per-example autograd reference ------------------------------------------------------------
# fp32 round-off over a few hundred accumulated products, relative to the sketch's scale
RTOL = 1e-4
ATOL_REL = 1e-5


def single_causal_losses(model, ids, labels, lengths) -> list[Callable[[], torch.Tensor]]:
    """One closure per example: its causal-LM loss, run alone and unpadded."""

    def single(b):
        n = lengths[b]
        return lambda: causal_lm_losses(
            model(input_ids=ids[b : b + 1, :n]).logits, labels[b : b + 1, :n]
        )[0]

    return [single(b) for b in range(len(lengths))]


def per_example_grads(
    model, layers, per_example_loss: Sequence[Callable[[], torch.Tensor]]
) -> list[list[np.ndarray]]:
    """Per example, per layer ``∇_W ℓ_i`` as ``(d_out, d_in)`` float64, from ``loss_i.backward()``.

    The one autograd loop every capture check compares against (Conv1D and embedding weights
    are stored ``(d_in, d_out)``: transposed here).
    """
    out = []
    for loss_fn in per_example_loss:
        model.zero_grad()
        loss_fn().backward()
        per_layer = []
        for layer in layers:
            w = layer.module.weight.grad
            G = w.T if layer.kind in ("conv1d", "embedding") else w
            per_layer.append(G.double().cpu().numpy().copy())
        out.append(per_layer)
    model.zero_grad()
    return out


def reference_sketches(model, layers, per_example_loss) -> list[list[np.ndarray]]:
    """Per example: per layer ``P_out G P_inᵀ`` with ``G`` from :func:`per_example_grads`."""
    out = []
    for grads in per_example_grads(model, layers, per_example_loss):
        per_layer = []
        for layer, G in zip(layers, grads, strict=True):
            Pin = np.eye(layer.d_in) if layer.P_in is None else layer.P_in.double().numpy()
            Pout = np.eye(layer.d_out) if layer.P_out is None else layer.P_out.double().numpy()
            per_layer.append(Pout @ G @ Pin.T)
        out.append(per_layer)
    return out


def best_rank_r(m: np.ndarray, r: int) -> np.ndarray:
    """The best rank-``r`` approximation of ``m`` (Eckart-Young), from LAPACK's SVD."""
    u, s, vt = np.linalg.svd(m)
    return (u[:, :r] * s[:r]) @ vt[:r]


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal to fp32 round-off, relative to the reference's largest entry."""
    scale = max(np.abs(want).max(), 1e-12)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL_REL * scale, err_msg=what)


def assert_same_ranking(got_ids, got_scores, want_ids, want_scores, atol: float, what="") -> None:
    """A ranking equal to the reference's up to float round-off.

    The scores agree position by position within ``atol``; the ids agree too, except that
    within a group of near-tied reference scores (neighbours closer than ``atol``) round-off
    of another code path (another kernel, thread count or CPU) may order them either way, so
    there only the sets must agree. Far from ties this is plain id equality.
    """
    got_ids, want_ids = np.asarray(got_ids), np.asarray(want_ids)
    got_s, want_s = np.asarray(got_scores, np.float64), np.asarray(want_scores, np.float64)
    assert got_ids.shape == want_ids.shape == want_s.shape, what
    np.testing.assert_allclose(got_s, want_s, rtol=0, atol=atol, err_msg=str(what))
    group = np.concatenate([[0], np.cumsum(np.abs(np.diff(want_s)) > atol)])
    for g in np.unique(group):
        at = group == g
        assert set(got_ids[at].tolist()) == set(want_ids[at].tolist()), (
            what, np.flatnonzero(at).tolist(), got_ids.tolist(), want_ids.tolist()
        )  # fmt: skip


def record_step(path: Path, model, settings: TrackSettings, ids, mask, losses_of) -> Store:
    """One tracked step of the batch ``ids`` (examples ``0..B-1``) written to ``path``.

    ``losses_of(logits)`` gives the ``(B,)`` per-example losses; returns the store (open).
    """
    with (
        Tracker(model, path, settings, background=False) as tracker,
        tracker.step(list(range(len(ids))), padding_mask=mask) as rec,
    ):
        losses = losses_of(model(input_ids=ids, attention_mask=mask).logits)
        losses.mean().backward()
        rec.losses = losses
    return Store(path)


def check_causal(tmp_path: Path, model, settings: TrackSettings):
    """Record :func:`causal_batch` and assert every sketch equals the per-example autograd one.

    Returns:
        The store and the tracked layers.
    """
    store, (ids, _, labels, lengths) = record_causal_step(tmp_path / "store.h5", model, settings)
    layers = build_layers(model, settings)
    ref = reference_sketches(model, layers, single_causal_losses(model, ids, labels, lengths))
    assert len(store.layers) == len(layers)
    for li, layer in enumerate(layers):
        got = store.sketches(li)
        for b in range(len(lengths)):
            assert_close(got[b], ref[b][li], f"layer {layer.name}, example {b}")
    return store, layers


def record_causal_step(path: Path, model, settings: TrackSettings, seed: int = 0):
    """One tracked step of :func:`causal_batch` (``seed``) written to ``path``.

    Returns:
        The store (open), and the batch ``ids, mask, labels, lengths``.
    """
    ids, mask, labels, lengths = causal_batch(seed)
    store = record_step(path, model, settings, ids, mask, lambda lg: causal_lm_losses(lg, labels))
    return store, (ids, mask, labels, lengths)


def train_own_loop(
    model, run_dir: Path, settings: TrackSettings, rows, class_ids=None, **finish
) -> Path:
    """An own loop recorded by a Tracker and finished into ``run_dir``: four AdamW steps (lr
    1e-3) of three equal-length token rows each, rows 0-2 then 3-5, twice. A causal LM's loss,
    or with ``class_ids`` (one per row) a classifier's; ``finish`` goes to
    ``Tracker.finish`` (``task``, ``labels``: the class names). Returns ``run_dir``."""
    from traceprop_engine.training.losses import classification_losses

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Tracker(model, run_dir / "store.h5", settings) as tracker:
        for step, start in enumerate([0, 3, 0, 3]):
            idx = list(range(start, start + 3))
            ids = torch.stack([torch.as_tensor(rows[i]) for i in idx])
            with tracker.step(idx, step=step, lr=1e-3) as rec:
                logits = model(input_ids=ids).logits
                if class_ids is None:
                    losses = causal_lm_losses(logits, ids)
                else:
                    losses = classification_losses(logits, torch.as_tensor(class_ids)[idx])
                losses.mean().backward()
                rec.losses = losses
            opt.step()
            opt.zero_grad()
    tracker.finish(model, **finish)
    return run_dir


def assert_same_answers(single_run, other_run) -> None:
    """A multi-process run (DDP shards, FSDP) answers an eval example's query as the one-process
    run of the same data does: the same top-5 rows either side, scores within 1 %."""
    import numpy as np

    from traceprop_engine.attribution.query import AttributionRun
    from traceprop_engine.store.reader import Store

    eval_id = int(np.flatnonzero(Store(single_run / "store.h5").examples()["split"] == "eval")[0])
    rows = []
    for run_dir in (single_run, other_run):
        run = AttributionRun(run_dir)
        try:
            rows.append(run.query(eval_example=eval_id, top_k=5).rows)
        finally:
            run.close()
    a, b = rows
    assert b.height == a.height == 10
    np.testing.assert_allclose(b["score"].to_numpy(), a["score"].to_numpy(), rtol=1e-2)
    atol = 1e-2 * float(np.abs(a["score"].to_numpy()).max())
    for kind in ("proponent", "opponent"):  # near ties may swap: float sums in another order
        x, y = a.filter(a["kind"] == kind), b.filter(b["kind"] == kind)
        assert_same_ranking(y["example_id"], y["score"], x["example_id"], x["score"], atol, kind)


def torchrun(world: int) -> list[str]:
    """The ``torchrun`` command line of the multi-process tests: ``world`` local processes,
    rendezvous on a free local port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]


def run_quietly(argv: Sequence[str]) -> None:
    """Run ``argv`` with one thread a process (outside any launcher: no ``WORLD_SIZE``) and
    assert it succeeded; a torchrun job's failure says why (:func:`torchrun_failure`)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        list(argv),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, torchrun_failure(p.stderr)


def run_torchrun(world: int, args: Sequence[str]) -> None:
    """Run ``args`` under :func:`torchrun` with ``world`` processes and assert it succeeded."""
    run_quietly([*torchrun(world), *args])


def torchrun_failure(stderr: str, lines_per_rank: int = 30) -> str:
    """What a failed ``torchrun`` job said, for an assertion message: the CLI's own ``error:``
    lines (a rank that exits 1 prints one and no traceback), the last lines of every rank's
    traceback (``[rankN]:``, so a root cause is not cut off by another rank's longer one) and
    the launcher's tail."""
    by_rank: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        if line.startswith("error: "):
            by_rank.setdefault("error", []).append(line)
        elif line.startswith("[rank") and "]:" in line:
            by_rank.setdefault(line.split("]:", 1)[0] + "]", []).append(line)
    parts = ["\n".join(v[-lines_per_rank:]) for _, v in sorted(by_rank.items())]
    return "\n...\n".join([*parts, stderr[-1500:]])


def write_factor_store(
    path: Path,
    shapes: Sequence[tuple[int, int]],
    arrays: Sequence[np.ndarray],
    examples: np.ndarray,
    rng: np.random.Generator,
    run_id: str,
    rank: int = 1,
    dtype: str = "int8",
    no_statistics: Sequence[int] = (),
) -> Store:
    """A completed synthetic store of rank-``rank`` factor records: ``arrays`` per layer (n,
    k_out + k_in, rank) float32 (``U`` on ``V``), record ``i`` of example ``examples[i]`` (lr
    falling from 1e-3 to 2e-4, 8 records a step), K-FAC statistics of random tokens (none, zero
    sums of zero tokens, for the layers ``no_statistics``)."""
    from types import SimpleNamespace

    from traceprop_engine import constants as C
    from traceprop_engine.store.format import Covariance
    from traceprop_engine.store.writer import StoreWriter

    layers = [
        SimpleNamespace(
            name=f"blk.{i}",
            kind="linear",
            d_in=32,
            d_out=32,
            k_in=ki,
            k_out=ko,
            rank=rank,
            factor_dtype=dtype,
            P_in=None,
            P_out=None,
            record_shape=(ko, ki),
        )  # fmt: skip
        for i, (ko, ki) in enumerate(shapes)
    ]
    w = StoreWriter(path, layers, {"run_id": run_id}, "factored")
    n = len(examples)
    per_epoch = int(np.max(examples, initial=0)) + 1
    meta = {
        C.REC_EXAMPLE: examples,
        C.REC_STEP: np.arange(n) // 8,
        C.REC_EPOCH: np.arange(n) // per_epoch,
        C.REC_LR: np.linspace(1e-3, 2e-4, n).astype(np.float32),
        C.REC_LOSS: rng.random(n).astype(np.float32),
    }
    for s0 in range(0, n, 64):
        w.append([a[s0 : s0 + 64] for a in arrays], {k: v[s0 : s0 + 64] for k, v in meta.items()})
    cov = []
    for li, (ko, ki) in enumerate(shapes):
        a, g = rng.normal(size=(300, ki)), rng.normal(size=(300, ko))
        if li in no_statistics:
            cov.append(Covariance(A=np.zeros((ki, ki)), S=np.zeros((ko, ko)), n_tokens=0))
        else:
            cov.append(Covariance(A=a.T @ a, S=g.T @ g, n_tokens=300))
    w.write_covariance(cov)
    w.close(C.STATUS_COMPLETED)
    return Store(path)


# a synthetic store (compact storage, Woodbury): 3 layers, no model
SYNTHETIC_SHAPES = [(6, 4), (5, 5), (3, 7)]  # (k_out, k_in) per layer: tall, square, wide
_SYN_EXAMPLES, _SYN_EPOCHS = 23, 2


def write_synthetic_store(path, seed=0, sketch="factored"):
    """A synthetic store: 3 layers, 23 examples seen twice with varying lr, K-FAC statistics."""
    from types import SimpleNamespace

    from traceprop_engine import constants as C
    from traceprop_engine.store.format import Covariance
    from traceprop_engine.store.writer import StoreWriter

    rng = np.random.default_rng(seed)
    layers = [
        SimpleNamespace(
            name=f"blk.{i}",
            kind="linear",
            d_in=16,
            d_out=16,
            k_in=ki,
            k_out=ko,
            P_in=None,
            P_out=None,
            record_shape=(ko, ki) if sketch == "factored" else (ko * ki,),
        )
        for i, (ko, ki) in enumerate(SYNTHETIC_SHAPES)
    ]
    w = StoreWriter(path, layers, {"run_id": f"synthetic-{seed}"}, sketch)
    ex = np.concatenate([rng.permutation(_SYN_EXAMPLES) for _ in range(_SYN_EPOCHS)])
    n = len(ex)
    # low-rank-ish sketches (decaying spectra), as per-example gradients are
    sk = []
    for ko, ki in SYNTHETIC_SHAPES:
        m = min(ko, ki)
        x = np.einsum(
            "nkc,c,nlc->nkl",
            rng.normal(size=(n, ko, m)),
            0.5 ** np.arange(m),
            rng.normal(size=(n, ki, m)),
        )
        sk.append(
            x.astype(np.float32) if sketch == "factored" else x.reshape(n, -1).astype(np.float32)
        )
    meta = {
        C.REC_EXAMPLE: ex,
        C.REC_STEP: np.arange(n) // 4,
        C.REC_EPOCH: np.arange(n) // _SYN_EXAMPLES,
        C.REC_LR: np.linspace(1e-3, 2e-4, n).astype(np.float32),
        C.REC_LOSS: rng.random(n).astype(np.float32),
    }
    for s0 in range(0, n, 10):  # several chunks, like the tracker's flushes
        w.append([x[s0 : s0 + 10] for x in sk], {k: v[s0 : s0 + 10] for k, v in meta.items()})
    cov = []
    for ko, ki in SYNTHETIC_SHAPES:
        a, g = rng.normal(size=(300, ki)) * np.linspace(0.3, 2, ki), rng.normal(size=(300, ko))
        cov.append(Covariance(A=a.T @ a, S=g.T @ g, n_tokens=300))
    if sketch == "factored":
        w.write_covariance(cov)
    w.close(C.STATUS_COMPLETED)
    return path


def reference_record_weights(rec: dict, records: str = "last-epoch") -> np.ndarray:
    """Each record's weight in its example's score, written out plainly (the brute forces'
    reference for ``IndexSettings.records``): ``all``, the step's learning rate; ``last-epoch``
    (the default), the mean learning rate of the record's epoch for the records of the last
    epoch its example was trained in, 0 for the others."""
    ex, ep, lr = (np.asarray(rec[k]) for k in (C.REC_EXAMPLE, C.REC_EPOCH, C.REC_LR))
    lr = lr.astype(np.float64)
    if str(getattr(records, "value", records)) == "all":
        return lr
    last, total, count = {}, {}, {}
    for e, p, r in zip(ex.tolist(), ep.tolist(), lr.tolist(), strict=True):
        last[e] = max(last.get(e, p), p)
        total[p] = total.get(p, 0.0) + r
        count[p] = count.get(p, 0) + 1
    pairs = zip(ex.tolist(), ep.tolist(), strict=True)
    return np.array([total[p] / count[p] if p == last[e] else 0.0 for e, p in pairs])


def store_only_run(indexes):
    """An ``AttributionRun`` over a bare store's ``RunIndexes`` (no run folder, no model): what
    the exact-score and list tests query; a causal LM's run for the settings' resolution."""
    from types import SimpleNamespace

    from traceprop_engine.attribution.query import AttributionRun

    run = AttributionRun.__new__(AttributionRun)
    run.indexes = indexes
    run.manifest = SimpleNamespace(task="causal-lm")
    return run
