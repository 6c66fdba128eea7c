"""LDS extra rows: levers against the engine's own scores, final-model gradients, new data sets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import facts_data, fast_settings

from traceprop_engine import constants as C
from traceprop_engine.attribution.query import open_run
from traceprop_engine.errors import ConfigError
from traceprop_engine.evaluate.hard_data import (
    HARD_TRAIN_FILE,
    HARD_TRUTH_FILE,
    generate_hard_facts,
)
from traceprop_engine.evaluate.lds import run_lds
from traceprop_engine.evaluate.lds_levers import (
    RecordProducts,
    final_gradients,
    final_model_methods,
    record_weights,
    same_label_scores,
    trained_parameters,
)
from traceprop_engine.evaluate.lds_settings import LdsSettings
from traceprop_engine.evaluate.prose_data import (
    FAMILIES,
    PACKAGE_FAMILIES,
    PROSE_EVAL_FILE,
    PROSE_TRAIN_FILE,
    generate_docstring_classes,
    stdlib_docstrings,
)
from traceprop_engine.settings import IndexSettings, TrackSettings
from traceprop_engine.training.losses import example_losses
from traceprop_engine.training.models import collate, load_saved_model, model_inputs

SCORE_RTOL = 1e-4  # float32 store products against the engine's float64 exact scorer
GRAD_ATOL = 1e-5  # a padded batch of two against two single-example backward passes (float32)
STREAM_RTOL = 1e-5  # streamed float32 products against float64 products of the same gradients


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    os.environ.setdefault("TQDM_DISABLE", "1")
    root = tmp_path_factory.mktemp("lev")
    data = facts_data(root / "facts")
    t = fast_settings(data, root / "unused", track=TrackSettings(k_in=4, k_out=4))
    s = LdsSettings(
        train=t,
        out=str(root / "ev"),
        n_subsets=4,
        k_values=(4,),
        main_k=4,
        dense=False,
        exact=False,
        bm25=False,
        bootstrap=200,
    )
    return s, run_lds(s)


def test_lever_and_final_model_rows_are_in_the_table(evaluated):
    s, r = evaluated
    rows = {row["method"]: row for row in r.rows}
    for m in (
        "lever lr layer",
        "lever last-epoch cosine",
        "full-gradient dot",
        "full-gradient cosine",
    ):
        assert m in rows and rows[m].get("error") is None, m
        assert -1 <= rows[m]["lds"] <= 1
    assert "same label" not in rows  # causal LM: no labels
    assert rows["full-gradient dot"]["n_params"] > 0


def test_record_products_reproduce_the_engines_cosine_and_dot(evaluated):
    s, _ = evaluated
    run = open_run(Path(s.out) / "runs" / "k4")
    try:
        ex = run.examples()
        eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()[:5]
        n_train = int((ex["split"] == C.SPLIT_TRAIN).sum())
        sks = [run.query_sketches(run.encode(eval_example=e)[0])[0] for e in eval_ids]
        tests = [np.concatenate([sk[li] for sk in sks]) for li in range(len(sks[0]))]
        prods = RecordProducts(run.store, tests, n_train)
        lr = record_weights(prods.records, "lr")
        for cosine, norm in ((True, "cosine"), (False, "dot")):
            ix = IndexSettings(preconditioner="identity", cosine=cosine, records="all")
            _, ids, _ = run.index(ix)
            want = np.stack([run.all_scores(sk, ix) for sk in sks])
            got = prods.scores(lr, norm)[:, ids]
            np.testing.assert_allclose(got, want, rtol=SCORE_RTOL, atol=1e-8 * np.abs(want).max())
        # per-layer normalisation: each layer's term is a cosine, so the sum is within ±L
        layer = prods.scores(lr, "layer")
        assert np.abs(layer).max() <= len(tests) + 1e-9
        last = record_weights(prods.records, "last-epoch")
        epochs = prods.records[C.REC_EPOCH]
        assert (last[epochs != epochs.max()] == 0).all() and (last > 0).any()
    finally:
        run.close()


def test_final_gradients_sum_to_the_gradient_of_a_padded_batch(evaluated):
    s, _ = evaluated
    run_dir = Path(s.out) / "runs" / "k4"
    run = open_run(run_dir)
    encs = [run.encode(eval_example=i)[0] for i in (0, 3)]
    run.close()
    g = final_gradients(run_dir / C.MODEL_DIR, encs, "causal-lm")
    loaded = load_saved_model(run_dir / C.MODEL_DIR, "cpu")
    params = trained_parameters(loaded.model)
    batch = collate(encs, loaded.tokenizer.pad_token_id, "causal-lm", "cpu")
    loss = example_losses(loaded.model(**model_inputs(batch)), batch, "causal-lm").sum()
    want = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)]).numpy()
    assert g.shape == (2, want.size)
    np.testing.assert_allclose(g.sum(0), want, atol=GRAD_ATOL)


def test_full_gradient_rows_stream_the_training_gradients(evaluated):
    """The streamed rows equal the products of the held (n, P) gradient matrices."""
    s, _ = evaluated
    run_dir = Path(s.out) / "runs" / "k4"
    run = open_run(run_dir)
    try:
        encs_tr = [run.encode(eval_example=i)[0] for i in range(5)]
        encs_ev = [run.encode(eval_example=i)[0] for i in (0, 2)]
    finally:
        run.close()
    g_tr = final_gradients(run_dir / C.MODEL_DIR, encs_tr, "causal-lm").astype(np.float64)
    g_ev = final_gradients(run_dir / C.MODEL_DIR, encs_ev, "causal-lm").astype(np.float64)
    rows = {r["method"]: r for r in final_model_methods(run_dir, [0, 2], 5)}
    want = g_ev @ g_tr.T
    got = rows["full-gradient dot"]["scores"]
    np.testing.assert_allclose(got, want, rtol=STREAM_RTOL, atol=STREAM_RTOL * np.abs(want).max())
    cos = want / np.linalg.norm(g_ev, axis=1)[:, None] / np.linalg.norm(g_tr, axis=1)[None]
    np.testing.assert_allclose(rows["full-gradient cosine"]["scores"], cos, atol=STREAM_RTOL)
    assert rows["full-gradient dot"]["n_params"] == g_tr.shape[1]


def test_same_label_scores():
    got = same_label_scores(["a", "b", "c", "a"], ["a", "c"])
    np.testing.assert_allclose(got, [[1, -0.5, -0.5, 1], [-0.5, -0.5, 1, -0.5]])


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _family_docs(family: str, families=FAMILIES):
    """Every docstring (whitespace collapsed) of the family's modules and their classes."""
    import importlib
    import inspect

    for name in families[family]:
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            for m in [obj, *(vars(obj).values() if inspect.isclass(obj) else ())]:
                doc = getattr(m, "__doc__", None)
                if isinstance(doc, str):
                    yield " ".join(inspect.cleandoc(doc).split())


def test_docstring_classes_are_stdlib_prose_deterministic_and_disjoint(tmp_path):
    generate_docstring_classes(tmp_path / "a", seed=3, n_train_per_class=5, n_eval_per_class=2)
    generate_docstring_classes(tmp_path / "b", seed=3, n_train_per_class=5, n_eval_per_class=2)
    for rel in (PROSE_TRAIN_FILE, PROSE_EVAL_FILE):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    train, ev = _jsonl(tmp_path / "a" / PROSE_TRAIN_FILE), _jsonl(tmp_path / "a" / PROSE_EVAL_FILE)
    assert len(train) == 5 * len(FAMILIES) and len(ev) == 2 * len(FAMILIES)
    assert {r["label"] for r in train} == set(FAMILIES)
    assert not {r["text"] for r in train} & {r["text"] for r in ev}
    # real docstrings of the running Python, each from a module of its row's family
    for r in train[:6]:
        assert any(r["text"] in docs for docs in _family_docs(r["label"])), r
    with pytest.raises(ConfigError, match="fewer than"):
        generate_docstring_classes(tmp_path / "c", n_train_per_class=10_000)


def test_package_docstring_classes_read_the_installed_libraries(tmp_path):
    """pkgdocs6: the same generator over six installed libraries, labelled by library; the
    versions it read are recorded, and a signature wrapped over lines is not prose."""
    info = generate_docstring_classes(
        tmp_path / "a", seed=2, n_train_per_class=4, n_eval_per_class=1, families=PACKAGE_FAMILIES
    )
    generate_docstring_classes(
        tmp_path / "b", seed=2, n_train_per_class=4, n_eval_per_class=1, families=PACKAGE_FAMILIES
    )
    assert (tmp_path / "a" / PROSE_TRAIN_FILE).read_bytes() == (
        tmp_path / "b" / PROSE_TRAIN_FILE
    ).read_bytes()
    train = _jsonl(tmp_path / "a" / PROSE_TRAIN_FILE)
    assert len(train) == 4 * 6 and {r["label"] for r in train} == set(PACKAGE_FAMILIES)
    assert set(info["versions"]) == {"numpy", "polars", "torch", "h5py", "transformers", "plotly"}
    assert info["versions"]["numpy"] == np.__version__
    for r in train[:6]:
        assert any(r["text"] in d for d in _family_docs(r["label"], PACKAGE_FAMILIES)), r
    from traceprop_engine.evaluate.prose_data import _first_paragraph

    wrapped = (
        "nested_iters(op, axes, flags=None, op_flags=None, op_dtypes=None,\n"
        "             order='K', casting='safe', buffersize=0)\n\nCreate nditers for use in loops."
    )
    assert _first_paragraph(wrapped) is None
    assert _first_paragraph(wrapped.replace("(", " ").replace(")", " ")) is not None


@pytest.mark.parametrize("name, families, n_train, n_eval", [
    ("docslm8", FAMILIES, 20, 6), ("pkgdocslm6", PACKAGE_FAMILIES, 24, 8)
])  # fmt: skip
def test_docstring_lm_sets_are_the_labelled_draw_without_labels(
    tmp_path, name, families, n_train, n_eval
):
    """docslm8 / pkgdocslm6: the docstrings of docs8's / pkgdocs6's draw (same seed, same rows
    in the same order), as ``{"text"}`` rows only, so `traceprop eval lds --set` trains them as
    a causal LM; source.json says so."""
    from traceprop_engine.evaluate.lds_sets import CLASSIFICATION_SETS, make_set

    assert name not in CLASSIFICATION_SETS
    train_dir, eval_dir = make_set(name, tmp_path / "ev", seed=1)
    train = _jsonl(Path(train_dir) / "docs.jsonl")
    ev = _jsonl(Path(eval_dir) / "docs.jsonl")
    assert len(train) == n_train * len(families) and len(ev) == n_eval * len(families)
    assert all(set(r) == {"text"} for r in train + ev)
    generate_docstring_classes(
        tmp_path / "cls", seed=1, n_train_per_class=n_train, n_eval_per_class=n_eval,
        families=families,
    )  # fmt: skip
    labelled = _jsonl(tmp_path / "cls" / PROSE_TRAIN_FILE)
    assert [r["text"] for r in train] == [r["text"] for r in labelled]
    info = json.loads((Path(train_dir).parent / "source.json").read_text())
    assert info["task"] == "causal-lm" and info["generator"].endswith("generate_docstring_texts")
    from traceprop_engine.training.data import load_examples

    examples, _ = load_examples(train_dir, task="causal-lm")
    assert len(examples) == len(train)


def test_stdlib_corpus_is_prose_disjoint_from_the_package_sets():
    """The pretraining corpus of ``pretrain_tiny.py --corpus prose``: standard-library
    docstrings kept by the same rule as the sets (60-400 characters, no code), each once, and
    none of the installed libraries' texts that pkgdocslm6 fine-tunes on."""
    from traceprop_engine.evaluate.prose_data import collect_docstrings

    pkg = {t for texts in collect_docstrings(PACKAGE_FAMILIES).values() for t in texts}
    whole = stdlib_docstrings()
    corpus = stdlib_docstrings(exclude=pkg)
    assert len(corpus) > 500 and len(set(corpus)) == len(corpus)
    assert all(60 <= len(t) <= 400 and ">>>" not in t for t in corpus)
    docs8 = {t for texts in collect_docstrings(FAMILIES).values() for t in texts}
    assert len(docs8 & set(corpus)) > 0.9 * len(docs8)  # the standard library's families
    assert len(pkg) > 500 and not pkg & set(corpus)
    assert set(corpus) == set(whole) - pkg  # an inherited docstring (abc.ABC's) is left out


def test_lexical_hard_variant_adds_contrast_and_echo_rows(tmp_path):
    truth = generate_hard_facts(tmp_path / "lex", seed=1, n_entities=6, variant="lexical")
    rows = _jsonl(tmp_path / "lex" / HARD_TRAIN_FILE)
    assert len(rows) == 5 * 6 and truth["variant"] == "lexical"
    for f in truth["eval"]:
        (c,), (e,) = f["contrast"], f["echo"]
        contrast, echo = rows[c["row"] - 1], rows[e["row"] - 1]
        assert f["entity"] in contrast["prompt"] and f["attribute"] in contrast["prompt"]
        assert contrast["completion"] != " " + f["answer"]
        assert f["entity"] in echo["prompt"] and echo["completion"] == " " + f["answer"]
    basic = generate_hard_facts(tmp_path / "basic", seed=1, n_entities=6)
    assert "variant" not in basic and "contrast" not in basic["eval"][0]
    assert "variant" not in json.loads((tmp_path / "basic" / HARD_TRUTH_FILE).read_text())
    with pytest.raises(ConfigError, match="variant"):
        generate_hard_facts(tmp_path / "x", variant="nope")


def test_named_sets_are_generated_beside_the_evaluation_folder(tmp_path):
    from traceprop_engine.evaluate.lds_sets import SETS, make_set

    for name in SETS:
        tr, ev = make_set(name, tmp_path / f"{name}-s1", seed=1)
        assert Path(tr).parent == tmp_path / f"{name}-s1-data"
        assert any(Path(tr).iterdir()) and any(Path(ev).iterdir())
    with pytest.raises(ConfigError, match="unknown LDS set"):
        make_set("nope", tmp_path / "x", 0)


def test_text_sets_are_the_base_draw_as_running_text(tmp_path):
    """hard60text / hard60doc: hard60's training rows, one or three a text (every token a
    target: no prompt), in order; the eval questions as hard60's."""
    from traceprop_engine.evaluate.lds_sets import make_set

    def rows(d):
        return [
            json.loads(x)
            for f in sorted(Path(d).glob("*.jsonl"))
            for x in f.read_text().splitlines()
        ]

    base_tr, base_ev = make_set("hard60", tmp_path / "b", seed=2)
    facts = [r["prompt"] + r["completion"] for r in rows(base_tr)]
    for name, per in (("hard60text", 1), ("hard60doc", 3)):
        tr, ev = make_set(name, tmp_path / name, seed=2)
        texts = [r["text"] for r in rows(tr)]
        assert all(set(r) == {"text"} for r in rows(tr))
        assert texts == [". ".join(facts[i : i + per]) for i in range(0, len(facts), per)]
        assert rows(ev) == rows(base_ev)


def test_cli_set_and_data_together_is_an_error(tmp_path, capsys):
    from traceprop_engine.cli.main import main

    rc = main(
        ["eval", "lds", "--set", "hard60", "--data", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    assert rc != 0 and "either --set or --data" in capsys.readouterr().err
