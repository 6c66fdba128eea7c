"""Your own training loop, first class: Tracker -> finish -> open_run -> query/scores by token ids.

A tiny GPT-NeoX built from a config, word-level token ids made by hand, no Hugging Face
tokenizer and no Trainer (issue 12). The Tracker on its own (and its misuse errors): test_tracker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engine_neox, reference_record_weights
from transformers import GPTNeoXForCausalLM

from traceprop_engine import QueryError, Tracker, TrackSettings
from traceprop_engine import constants as C
from traceprop_engine.attribution.query import open_run
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.reader import Store
from traceprop_engine.training.losses import causal_lm_losses

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["the cat sat", "the dog ran", "a cat ran", "the bird sang", "a dog sat", "the cat ran"]
VOCAB = {w: i + 1 for i, w in enumerate(sorted({w for t in TEXTS for w in t.split()}))}
EXAMPLES = [[VOCAB[w] for w in t.split()] + [0] for t in TEXTS]
LR = [1e-3, 5e-4]  # per epoch: records carry their lr
QUERY = [VOCAB["the"], VOCAB["cat"], VOCAB["sat"], 0]
QUERY_LABELS = [-100, -100, VOCAB["sat"], 0]


def tiny_model(seed: int = 0) -> GPTNeoXForCausalLM:
    return engine_neox(len(VOCAB) + 1, width=64, layers=2, seed=seed)


def train(run_dir: Path, *, epochs: int = 2, with_table: bool = True, tracker_kw=None) -> Tracker:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Tracker(
        model, run_dir / "store.h5", TrackSettings(k_in=8, k_out=8), **(tracker_kw or {})
    ) as tracker:
        if with_table:
            tracker.write_examples(
                {
                    "source": ["mine.txt"] * len(TEXTS),
                    "row": list(range(1, len(TEXTS) + 1)),
                    "sha256": [""] * len(TEXTS),
                    "split": ["train"] * len(TEXTS),
                    "text": TEXTS,
                },
                [np.array(e) for e in EXAMPLES],
                [np.array([0] + [1] * (len(e) - 1)) for e in EXAMPLES],
            )
        step = 0
        for epoch in range(epochs):
            for start in range(0, len(EXAMPLES), 3):
                idx = list(range(start, start + 3))
                ids = torch.tensor([EXAMPLES[i] for i in idx])
                with tracker.step(idx, step=step, epoch=epoch, lr=LR[epoch]) as rec:
                    losses = causal_lm_losses(model(input_ids=ids).logits, ids)
                    losses.mean().backward()
                    rec.losses = losses
                opt.step()
                opt.zero_grad()
                step += 1
    tracker.trained_model = model
    return tracker


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ownloop")
    tracker = train(d)
    tracker.finish(tracker.trained_model)
    return d


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_finish_makes_a_run_that_open_run_and_the_cli_accept(run_dir):
    m = json.loads((run_dir / C.MANIFEST_FILE).read_text())
    assert m["status"] == C.STATUS_COMPLETED
    assert m["model"]["tokenizer"] is False
    assert m["config"]["trainer"] == "traceprop_engine.Tracker"
    assert (run_dir / C.MODEL_DIR / "traceprop_model.json").exists()
    assert m["store"]["n_records"] == 12 and m["timings"]["n_steps"] == 4
    assert m["tracking"]["k_in"] == 8 and len(m["tracking"]["layers"]) > 0
    run = open_run(run_dir)
    assert run.store.n_records == 12
    assert run.model().tokenizer is None
    info = subprocess.run(
        [sys.executable, "-m", "traceprop_engine", "info", str(run_dir)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert info.returncode == 0, info.stderr
    assert "status completed" in info.stdout and "12 records" in info.stdout
    q = subprocess.run(
        [sys.executable, "-m", "traceprop_engine", "query", str(run_dir), "--eval-example", "0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert q.returncode == 0, q.stderr
    assert "the cat sat" in q.stdout


def test_finish_with_a_tokenizer_answers_text_queries(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a word-level Hugging Face tokenizer over the same ids the loop used
    wl = Tokenizer(models.WordLevel({"<eos>": 0, **VOCAB}, unk_token="<eos>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="<eos>", pad_token="<eos>")
    assert tok("the cat sat", add_special_tokens=False)["input_ids"] == EXAMPLES[0][:-1]
    tracker = train(tmp_path, epochs=1)
    tracker.finish(tracker.trained_model, tok)
    run = open_run(tmp_path)
    assert run.model().tokenizer is not None
    res = run.query(prompt="the cat", completion=" sat", top_k=2)
    assert res.rows.height == 4
    s = run.scores(prompt="the cat", completion=" sat")
    best = res.proponents.row(0, named=True)
    assert s[best["example_id"]] == pytest.approx(best["score"], rel=1e-4)


def test_query_by_token_ids_without_a_tokenizer(run_dir):
    run = open_run(run_dir)
    res = run.query(input_ids=QUERY, labels=QUERY_LABELS, top_k=3)
    # rows follow the sign: at most 3 proponents (> 0) and 3 opponents (< 0)
    assert 1 <= res.proponents.height <= 3 and (res.proponents["score"] > 0).all()
    assert res.opponents.height <= 3 and (res.opponents["score"] < 0).all()
    assert res.query["input_ids"] == QUERY and res.query["loss_mask"] == [0, 0, 1, 1]
    # the same query as a loss mask and as tensors
    res2 = run.query(input_ids=torch.tensor([QUERY]), loss_mask=np.array([0, 0, 1, 1]), top_k=3)
    assert res2.rows["score"].to_list() == pytest.approx(res.rows["score"].to_list(), rel=1e-6)
    assert res.proponents["text"][0] == "the cat sat"
    with pytest.raises(QueryError, match="no tokenizer"):
        run.query(prompt="the cat", completion=" sat")
    with pytest.raises(QueryError, match="equal input_ids"):
        run.query(input_ids=QUERY, labels=[-100, 5, 5, 0])
    with pytest.raises(QueryError, match="no target"):
        run.query(input_ids=QUERY, labels=[VOCAB["the"], -100, -100, -100])
    with pytest.raises(QueryError, match="vocabulary"):
        run.query(input_ids=[1, 2, 999])


def _brute_force(run_dir: Path, query_sketches: list[np.ndarray]) -> np.ndarray:
    """Identity preconditioner: Σ_records w · ⟨sketch_query, sketch_record⟩, per example (``w``:
    the default records' weights, the last epoch's)."""
    st = Store(run_dir / "store.h5")
    rec = st.records()
    weight = reference_record_weights(rec)
    out = np.zeros(len(TEXTS))
    for r in range(st.n_records):
        dot = sum(
            float(np.dot(query_sketches[li].ravel(), st.sketches(li, r, r + 1).ravel()))
            for li in range(len(st.layers))
        )
        out[rec[C.REC_EXAMPLE][r]] += weight[r] * dot
    st.close()
    return out


def test_scores_match_query_and_a_brute_force_from_the_sketches(run_dir):
    run = open_run(run_dir)
    # default (K-FAC): the vector agrees with every row query() returns
    s = run.scores(input_ids=QUERY, labels=QUERY_LABELS)
    assert isinstance(s, np.ndarray) and s.shape == (len(TEXTS),)
    res = run.query(input_ids=QUERY, labels=QUERY_LABELS, top_k=3)
    for r in res.rows.iter_rows(named=True):
        assert s[r["example_id"]] == pytest.approx(r["score"], rel=1e-4, abs=1e-9)
    assert int(np.argmax(s)) == res.proponents["example_id"][0]
    # identity preconditioner: exactly the lr-weighted inner products of the stored sketches
    ident = IndexSettings(preconditioner="identity", cosine=False)
    si = run.scores(input_ids=QUERY, labels=QUERY_LABELS, settings=ident)
    enc, _, _ = run.encode(input_ids=QUERY, labels=QUERY_LABELS)
    sk, _ = run.query_sketches(enc)
    want = _brute_force(run_dir, sk)
    np.testing.assert_allclose(si, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    assert np.abs(want).max() > 0


def test_scores_of_a_batch_is_a_matrix_of_the_single_queries(run_dir):
    run = open_run(run_dir)
    other = EXAMPLES[1]
    m = run.scores(input_ids=[QUERY, other], labels=[QUERY_LABELS, other])
    assert m.shape == (2, len(TEXTS))
    np.testing.assert_allclose(m[0], run.scores(input_ids=QUERY, labels=QUERY_LABELS), rtol=1e-6)
    np.testing.assert_allclose(m[1], run.scores(input_ids=other), rtol=1e-6)
    m2 = run.scores(input_ids=np.array([QUERY, other]), loss_mask=[[0, 0, 1, 1], [0, 1, 1, 1]])
    np.testing.assert_allclose(m2, m, rtol=1e-6)
    ev = run.scores(eval_example=[0, 1])
    assert ev.shape == (2, len(TEXTS))
    with pytest.raises(QueryError, match="per_record"):
        run.scores(input_ids=QUERY, settings=IndexSettings(per_record=True))


def test_a_query_keeps_the_callers_torch_thread_count(run_dir):
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        run = open_run(run_dir)
        run.query(
            input_ids=QUERY, labels=QUERY_LABELS, top_k=2, settings=IndexSettings(damping=0.5)
        )
        assert torch.get_num_threads() == 1
        run.scores(input_ids=QUERY)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(prev)


def test_library_use_is_quiet_and_restores_hf_progress_settings(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    tracker = train(tmp_path, epochs=1)
    capfd.readouterr()
    tracker.finish(tracker.trained_model)
    run = open_run(tmp_path)
    run.query(input_ids=QUERY, labels=QUERY_LABELS, top_k=1)
    out, err = capfd.readouterr()
    assert "it/s" not in err and "Loading weights" not in err and "shards" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is back


def test_influence_by_source_of_an_id_query_rebuilt_from_its_description(run_dir):
    run = open_run(run_dir)
    res = run.query(input_ids=QUERY, labels=QUERY_LABELS, top_k=2)
    direct = run.influence_by_source(res)
    res.sketches = None  # as from an audit trail: re-encoded from res.query
    rebuilt = run.influence_by_source(res)
    assert rebuilt["total"].to_list() == pytest.approx(direct["total"].to_list(), rel=1e-5)
    assert rebuilt["total"][0] == pytest.approx(
        float(run.scores(input_ids=QUERY, labels=QUERY_LABELS).sum()), rel=1e-4
    )


def test_the_app_lists_and_queries_a_tracker_run(run_dir, tmp_path):
    sys.path.insert(0, str(ROOT))
    from app import services

    cfg = services.AppConfig(runs_root=run_dir.parent, sample_runs=tmp_path, data_root=tmp_path)
    row = services.run_summary(cfg, run_dir)
    assert row["status"] == "completed" and row["records"] == 12, row
    assert row["tracked layers"] > 0 and row["k"] == "8x8"
    res, by_source = services.run_query(run_dir, eval_example=0, top_k=2)
    assert 1 <= res.proponents.height <= 2 and res.opponents.height <= 2
    assert by_source["source"].to_list() == ["mine.txt"]
    assert services.decode_tokens(
        run_dir, np.array(EXAMPLES[0]), np.array([0, 1, 1, 1])
    ).startswith("ids: ")
