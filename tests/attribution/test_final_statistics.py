"""``IndexSettings.statistics``: K-FAC statistics fitted on the final model, checked against the
hand-computed projected ``A = Σ ã ãᵀ``, ``S = Σ g̃ g̃ᵀ`` of every trained token, how ``auto``
resolves, the cache beside the indexes and the errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import facts_data, fast_settings

from traceprop_engine import constants as C
from traceprop_engine.attribution.model_side import statistics as ST
from traceprop_engine.attribution.query import open_run
from traceprop_engine.cli.main import main
from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import IndexSettings, LayerWeighting, StatisticsSource, TrackSettings
from traceprop_engine.training.loop import train
from traceprop_engine.training.losses import example_losses
from traceprop_engine.training.models import collate, model_inputs

STATS_RTOL = 1e-4  # batched, padded float32 sums against one example at a time (float64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A tiny LM trained from scratch, and one fine-tuned in full from its saved weights."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    tmp = tmp_path_factory.mktemp("finalstats")
    data = facts_data(tmp / "facts")
    track = TrackSettings(k_in=8, k_out=8)
    scratch = train(fast_settings(data, tmp / "scratch", track=track))
    full = train(
        fast_settings(data, tmp / "full", track=track, model=str(scratch / C.MODEL_DIR), epochs=2)
    )
    return {"scratch": scratch, "full": full}


def _reference(run) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Per layer the projected statistics of every trained example, one example at a time."""
    loaded = run.model()
    layers = run.tracked_layers()
    sums = [
        [np.zeros((x.k_in, x.k_in)), np.zeros((x.k_out, x.k_out)), 0.0] for x in run.store.layers
    ]
    seen: dict[int, list] = {}

    def hook(li):
        def fwd(module, inputs, output):
            seen[li] = [inputs[0].detach()]
            output.register_hook(lambda g: seen[li].append(g.detach()))

        return fwd

    handles = [x.module.register_forward_hook(hook(li)) for li, x in enumerate(layers)]
    try:
        for i in ST.statistics_examples(run.store):
            enc = run.encode(eval_example=int(i))[0]
            batch = collate([enc], 0, run.task, "cpu")
            with torch.enable_grad():
                example_losses(
                    loaded.model(**model_inputs(batch)), batch, run.task
                ).sum().backward()
            loaded.model.zero_grad(set_to_none=True)
            for li, x in enumerate(layers):
                a, g = (t.reshape(-1, t.shape[-1]).double() for t in seen[li])
                a = a @ x.P_in.double().T if x.P_in is not None else a
                g = g @ x.P_out.double().T if x.P_out is not None else g
                sums[li][0] += (a.T @ a).numpy()
                sums[li][1] += (g.T @ g).numpy()
                sums[li][2] += a.shape[0]
    finally:
        for h in handles:
            h.remove()
    return [tuple(s) for s in sums]


def test_final_statistics_are_the_hand_computed_projected_factors(runs):
    run = open_run(runs["scratch"])
    try:
        got = ST.fit_final_statistics(run)
        want = _reference(run)
        assert len(got) == len(want) == len(run.store.layers)
        for c, (A, S, n) in zip(got, want, strict=True):
            assert c.n_tokens == n
            np.testing.assert_allclose(c.A, A, rtol=STATS_RTOL, atol=STATS_RTOL * np.abs(A).max())
            np.testing.assert_allclose(c.S, S, rtol=STATS_RTOL, atol=STATS_RTOL * np.abs(S).max())
        # the mean of both: per-token means averaged, at the inline token count
        inline = [run.store.covariance(li) for li in range(len(got))]
        mixed = ST.mean_statistics(inline, got)
        for m, a, b in zip(mixed, inline, got, strict=True):
            assert m.n_tokens == a.n_tokens
            np.testing.assert_allclose(m.A / m.n_tokens, (a.A / a.n_tokens + b.A / b.n_tokens) / 2)
    finally:
        run.close()


def test_auto_is_both_for_a_pretrained_lm_fine_tuned_in_full(runs, capsys):
    scratch, full = open_run(runs["scratch"]), open_run(runs["full"])
    try:
        assert full.store.model_origin == C.ORIGIN_PRETRAINED_FULL
        s = full.settings()
        assert (s.weighting, s.statistics) == (LayerWeighting.FISHER, StatisticsSource.BOTH)
        assert s.name == "kfac-cos-fisher-stats-both"
        # from scratch, under recorded weighting, and for identity: the inline statistics
        assert scratch.settings().statistics is StatisticsSource.INLINE
        assert scratch.settings().name == "kfac-cos"
        recorded = full.settings(IndexSettings(weighting="recorded"))
        assert recorded.statistics is StatisticsSource.INLINE
        assert full.settings(IndexSettings(preconditioner="identity", statistics="final")).name == (
            "identity-cos"
        )
        # inline keeps every older index's fingerprint: no key, no name part
        assert "statistics" not in IndexSettings(statistics="inline").to_dict()
        assert IndexSettings(statistics="final").to_dict()["statistics"] == "final"

        query = full.encode(eval_example=0)[0]
        sk = full.query_sketches(query)[0]
        by = {
            st: full.all_scores(sk, IndexSettings(statistics=st))
            for st in ("auto", "inline", "final", "both")
        }
        np.testing.assert_array_equal(by["auto"], by["both"])
        assert not np.allclose(by["inline"], by["final"], rtol=1e-3)
        res = full.query(eval_example=0, top_k=2)
        assert (res.query["weighting"], res.query["statistics"]) == ("fisher", "both")
        # the final model's statistics are cached beside the indexes, for this store and model
        cached = full.index_root() / ST.CACHE_FILE
        assert cached.is_file()
    finally:
        scratch.close()
        full.close()
    assert main(["index", str(runs["full"]), "--statistics", "final"]) == 0
    assert "index kfac-cos-fisher-stats-final:" in capsys.readouterr().out


def test_the_cache_is_used_and_refitted_when_stale(runs, monkeypatch):
    run = open_run(runs["full"])
    try:
        root = run.index_root()
        first = ST.final_statistics(run, root)

        def no_pass(*a, **k):
            raise AssertionError("fitted again although the cache holds them")

        monkeypatch.setattr(ST, "fit_final_statistics", no_pass)
        again = ST.final_statistics(run, root)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a.A, b.A)
            assert a.n_tokens == b.n_tokens
        # another key (e.g. another model) is not these statistics: refitted
        monkeypatch.setattr(ST, "CACHE_FORMAT", ST.CACHE_FORMAT + 1)
        with pytest.raises(AssertionError, match="fitted again"):
            ST.final_statistics(run, root)
        # a damaged cache file is refitted, never read
        monkeypatch.undo()
        (root / ST.CACHE_FILE).write_bytes(b"not an npz")
        assert ST.load_cached(root / ST.CACHE_FILE, ST.cache_key(run), len(first)) is None
        fresh = ST.final_statistics(run, root)
        np.testing.assert_allclose(fresh[0].S, first[0].S)
    finally:
        run.close()


def test_a_store_without_example_tokens_keeps_the_inline_statistics(runs, tmp_path):
    run = open_run(runs["full"])
    try:
        monkey = type(run.store).n_examples
        # what a Tracker in one's own loop writes without write_examples(): no tokens to fit on
        type(run.store).n_examples = property(lambda self: 0)
        try:
            assert run.settings().statistics is StatisticsSource.INLINE
            with pytest.raises(StoreError, match="--statistics inline"):
                ST.fit_final_statistics(run)
        finally:
            type(run.store).n_examples = monkey
    finally:
        run.close()


def test_bad_statistics_is_a_clear_error():
    with pytest.raises(ConfigError, match="statistics"):
        IndexSettings(statistics="latest")


def test_a_query_worker_fits_them_and_this_process_never_loads_the_model(runs, monkeypatch):
    """The app's process stays free of torch: its worker's warm-up caches the statistics."""
    from traceprop_engine.attribution import QueryWorker

    run = open_run(runs["full"])
    try:
        (run.index_root() / ST.CACHE_FILE).unlink(missing_ok=True)
        with QueryWorker() as worker:
            worker.call("warm", runs["full"])

        def no_pass(*a, **k):
            raise AssertionError("fitted here although the worker cached them")

        monkeypatch.setattr(ST, "fit_final_statistics", no_pass)
        run.index(rebuild=True)
        assert run._encoder is None  # no model loaded in this process
    finally:
        run.close()
