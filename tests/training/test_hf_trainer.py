"""The Hugging Face Trainer integration records what the engine's own loop records."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import engine_neox, facts_data
from peft import LoraConfig, get_peft_model
from torch.utils.data import SequentialSampler
from transformers import TrainingArguments

from traceprop_engine import ConfigError, Store, Tracker, TrackSettings
from traceprop_engine.training.data import load_examples
from traceprop_engine.training.hf_trainer import (
    TracepropCollator,
    TracepropTrainer,
    encoded_dataset,
    rank_store_path,
)
from traceprop_engine.training.losses import causal_lm_losses
from traceprop_engine.training.models import collate, encode_example, train_tokenizer

# fp32 round-off between two runs of the same math in a different order of operations
RTOL = 1e-4
ATOL_REL = 1e-5
N = 16
TRACK = TrackSettings(k_in=4, k_out=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    root = facts_data(tmp_path_factory.mktemp("data"))
    examples, _ = load_examples(str(root / "train"), task="causal-lm")
    examples = examples[:N]
    tok = train_tokenizer([e.full_text() for e in examples], 300)
    enc = [encode_example(e, tok, "causal-lm", 48) for e in examples]
    model = engine_neox(max(300, len(tok)), width=32, layers=1, pad_token_id=tok.pad_token_id)
    return model, tok, enc


class _InOrder(TracepropTrainer):
    """The dataset's own order, so the manual loop can follow it."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


def _run_trainer(model, tok, enc, path, *, lr, accum, epochs=1, **extra):
    args = TrainingArguments(
        output_dir=str(path.parent / "hf_out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        num_train_epochs=epochs,
        learning_rate=lr,
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    with Tracker(model, path, TRACK, background=False) as tracker:
        trainer = _InOrder(
            model=model,
            args=args,
            train_dataset=encoded_dataset(enc),
            data_collator=TracepropCollator(pad_id=tok.pad_token_id),
            tracker=tracker,
        )
        trainer.train()
    return Store(path)


def _run_manual(model, tok, enc, path, *, lrs, epochs=1, batch=4):
    """The engine's own loop: Tracker driven by hand, AdamW with the given per-step lr."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0, eps=1e-8
    )
    step = 0
    with Tracker(model, path, TRACK, background=False) as tracker:
        for epoch in range(epochs):
            for s in range(0, len(enc), batch):
                idx = np.arange(s, min(s + batch, len(enc)))
                b = collate([enc[i] for i in idx], tok.pad_token_id, "causal-lm", "cpu")
                lr = float(lrs[step])
                for g in opt.param_groups:
                    g["lr"] = lr
                with tracker.step(
                    idx, padding_mask=b["attention_mask"], step=step, epoch=epoch, lr=lr
                ) as rec:
                    losses = causal_lm_losses(
                        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                        b["labels"],
                    )
                    losses.mean().backward()
                    rec.losses = losses
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
    return Store(path)


def _assert_same_sketches(a: Store, b: Store) -> None:
    ra, rb = a.records(), b.records()
    assert a.n_records == b.n_records > 0
    np.testing.assert_array_equal(ra["example_index"], rb["example_index"])
    np.testing.assert_array_equal(ra["epoch"], rb["epoch"])
    np.testing.assert_allclose(ra["loss"], rb["loss"], rtol=RTOL)
    assert [layer.name for layer in a.layers] == [layer.name for layer in b.layers]
    for li in range(len(a.layers)):
        x, y = a.sketches(li), b.sketches(li)
        scale = max(float(np.abs(y).max()), 1e-12)
        np.testing.assert_allclose(
            x, y, rtol=RTOL, atol=ATOL_REL * scale, err_msg=a.layers[li].name
        )
        ca, cb = a.covariance(li), b.covariance(li)
        assert ca.n_tokens == cb.n_tokens
        np.testing.assert_allclose(ca.S, cb.S, rtol=RTOL, atol=ATOL_REL * np.abs(cb.S).max())
        np.testing.assert_allclose(ca.A, cb.A, rtol=RTOL, atol=ATOL_REL * np.abs(cb.A).max())


def test_trainer_matches_manual_loop_with_training(setup, tmp_path):
    """lr > 0, two epochs, no accumulation: the manual loop replays the Trainer's recorded lr."""
    model, tok, enc = setup
    m_hf, m_ref = copy.deepcopy(model), copy.deepcopy(model)
    hf = _run_trainer(m_hf, tok, enc, tmp_path / "hf.h5", lr=3e-3, accum=1, epochs=2)
    rec = hf.records()
    steps = np.unique(rec["step"])
    np.testing.assert_array_equal(
        steps, np.arange(2 * N // 4)
    )  # one optimizer step per micro-batch
    lrs = np.array([rec["lr"][rec["step"] == s][0] for s in steps], np.float64)
    # the Trainer's linear schedule, read from the records: 3e-3 · (1 - step / total)
    np.testing.assert_allclose(lrs, 3e-3 * (1 - steps / len(steps)), rtol=1e-6)
    assert set(rec["epoch"]) == {0, 1}
    ref = _run_manual(m_ref, tok, enc, tmp_path / "ref.h5", lrs=lrs, epochs=2)
    _assert_same_sketches(hf, ref)
    # and the same training: Adam amplifies round-off on near-zero gradients, so compare the
    # parameter difference with how far training moved the parameters
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    moved = (flat(m_ref) - flat(model)).norm()
    assert moved > 0.1 and (flat(m_hf) - flat(m_ref)).norm() / moved < 1e-3


def test_gradient_accumulation_scales_to_each_examples_own_loss(setup, tmp_path):
    model, tok, enc = setup
    hf = _run_trainer(copy.deepcopy(model), tok, enc, tmp_path / "hf.h5", lr=0.0, accum=2)
    ref = _run_manual(copy.deepcopy(model), tok, enc, tmp_path / "ref.h5", lrs=np.zeros(N))
    rec = hf.records()
    assert list(rec["step"]) == [0] * 8 + [1] * 8  # two micro-batches per optimizer step
    _assert_same_sketches(hf, ref)


def test_lora_adapters_match_manual_loop(setup, tmp_path):
    model, tok, enc = setup
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        target_modules=["query_key_value", "dense_4h_to_h"],
        init_lora_weights=False,
    )  # random A and B: both sides carry a gradient
    peft_model = get_peft_model(copy.deepcopy(model), cfg)
    hf = _run_trainer(copy.deepcopy(peft_model), tok, enc, tmp_path / "hf.h5", lr=0.0, accum=2)
    ref = _run_manual(copy.deepcopy(peft_model), tok, enc, tmp_path / "ref.h5", lrs=np.zeros(N))
    names = [layer.name for layer in hf.layers]
    assert names and all("lora_" in n for n in names)
    _assert_same_sketches(hf, ref)


def test_bf16_autocast_records_finite_sketches(setup, tmp_path):
    """Mixed precision where the device supports it (bf16 autocast on CPU here)."""
    model, tok, enc = setup
    hf = _run_trainer(
        copy.deepcopy(model), tok, enc, tmp_path / "bf16.h5", lr=0.0, accum=1, bf16=True
    )
    ref = _run_manual(copy.deepcopy(model), tok, enc, tmp_path / "ref.h5", lrs=np.zeros(N))
    for li in range(len(ref.layers)):
        x, y = hf.sketches(li), ref.sketches(li)
        assert np.all(np.isfinite(x))
        # bf16 keeps ~3 significant digits: the sketches agree to bf16 round-off
        rel = np.linalg.norm(x - y) / np.linalg.norm(y)
        assert rel < 0.05, (ref.layers[li].name, rel)


def test_collator_requires_example_index(setup):
    _, tok, enc = setup
    rows = encoded_dataset(enc, [3, 5])
    batch = TracepropCollator(pad_id=tok.pad_token_id)(rows)
    assert batch["example_index"].tolist() == [3, 5] and batch["input_ids"].shape[0] == 2
    del rows[0]["example_index"]
    with pytest.raises(ConfigError, match="example_index"):
        TracepropCollator(pad_id=tok.pad_token_id)(rows)


def test_rank_store_path(tmp_path):
    assert rank_store_path(tmp_path / "store.h5", 0, 1) == tmp_path / "store.h5"
    assert rank_store_path(tmp_path / "store.h5", 1, 2) == tmp_path / "store.rank1.h5"


def test_finish_run_makes_a_queryable_run(setup, tmp_path):
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.training.hf_trainer import finish_run

    model, tok, enc = setup
    model = copy.deepcopy(model)
    run_dir = tmp_path / "hfrun"
    run_dir.mkdir()
    _run_trainer(model, tok, enc, run_dir / "store.h5", lr=1e-3, accum=1)
    finish_run(run_dir, model, tok, max_length=48)
    run = open_run(run_dir)
    res = run.query("Q: What colour is the planet X?\nA:", " teal", top_k=3)
    assert res.proponents.height == 3 and res.rows["example_id"].max() < N


def test_finish_run_saves_a_peft_base_built_from_a_config(setup, tmp_path):
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.training.hf_trainer import finish_run

    base, tok, enc = setup
    cfg = LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        target_modules=["query_key_value"],
        init_lora_weights=False,
    )
    model = get_peft_model(copy.deepcopy(base), cfg)
    run_dir = tmp_path / "hflora"
    run_dir.mkdir()
    _run_trainer(model, tok, enc, run_dir / "store.h5", lr=1e-3, accum=1)
    finish_run(run_dir, model, tok, max_length=48)
    assert (run_dir / "model" / "base" / "config.json").exists()
    assert open_run(run_dir).query("Q: a\nA:", " b", top_k=2).proponents.height == 2
