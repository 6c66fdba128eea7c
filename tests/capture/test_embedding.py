"""The input embedding's record (``TrackSettings.embedding``): equal to the per-example autograd
gradient of ``nn.Embedding.weight`` through its projections, recorded when ``auto`` says so, and
queried like any other layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import (
    assert_close,
    causal_batch,
    check_causal,
    per_example_grads,
    record_causal_step,
    reference_record_weights,
    single_causal_losses,
    tiny_bert_classifier,
    tiny_neox,
    train_own_loop,
)
from peft import LoraConfig, get_peft_model
from transformers import GPTNeoXForCausalLM

from traceprop_engine import ConfigError, TrackSettings
from traceprop_engine import constants as C
from traceprop_engine.capture.layers import build_layers, embedding_layer

EMBED = "gpt_neox.embed_in"


def _saved_and_loaded(model, tmp_path) -> GPTNeoXForCausalLM:
    """The same weights loaded back with from_pretrained: a 'pretrained' model."""
    model.save_pretrained(tmp_path / "pretrained")
    return GPTNeoXForCausalLM.from_pretrained(tmp_path / "pretrained").eval()


def test_full_sketch_of_the_embedding_matches_autograd(tmp_path):
    """rank 0: P_out G P_inᵀ with G = ∇ embed_in.weightᵀ (d × V), from gathered columns of P_in."""
    store, layers = check_causal(
        tmp_path, tiny_neox(), TrackSettings(rank=0, k_in=4, k_out=6, embedding="on")
    )
    assert layers[0].name == EMBED and layers[0].kind == "embedding"
    assert store.layers[0].kind == "embedding" and store.layers[0].d_in == 97
    assert (store.layers[0].k_in, store.layers[0].k_out) == (4, 6)
    assert len(layers) == 1 + 2 * 4 + 1  # the embedding, then the linear layers as before


def test_unprojected_embedding_is_the_exact_gradient(tmp_path):
    """k_in >= the vocabulary: the one-hot inputs themselves, so the record is G exactly."""
    settings = TrackSettings(rank=0, k_in=10_000, k_out=10_000, embedding="on", scope="last-block")
    _, layers = check_causal(tmp_path, tiny_neox(), settings)
    assert layers[0].kind == "embedding" and layers[0].P_in is None


@pytest.mark.parametrize("k", [(8, 6), (10_000, 10_000)])
def test_default_record_is_the_half_step_factor_of_autograd(tmp_path, k):
    """The default rank-1 record: ``P_out σ σᵀ G P_inᵀ / ‖σ‖²`` with ``σ = Σ_t g_t``, which for an
    embedding is ``G 1`` (each token adds its g_t to its own column), so autograd gives it."""
    model = tiny_neox()
    settings = TrackSettings(k_in=k[0], k_out=k[1], factor_dtype="float32", embedding="on")
    store, (ids, _, labels, lengths) = record_causal_step(tmp_path / "store.h5", model, settings)
    layers = build_layers(model, settings)
    assert layers[0].kind == "embedding" and layers[0].full_factor
    grads = per_example_grads(model, layers[:1], single_causal_losses(model, ids, labels, lengths))
    e = layers[0]
    p_in = np.eye(e.d_in) if e.P_in is None else e.P_in.double().numpy()
    p_out = np.eye(e.d_out) if e.P_out is None else e.P_out.double().numpy()
    got = store.sketches(0)
    for b, (G,) in enumerate(grads):
        sigma = G.sum(1)
        want = p_out @ np.outer(sigma, sigma @ G) @ p_in.T / (sigma @ sigma)
        assert_close(got[b], want, f"example {b}")


def test_padding_token_rows_are_left_out_as_autograd_does(tmp_path):
    """An embedding with padding_idx: autograd gives that token's row no gradient; neither does
    the record (an id of the batch is made the padding id)."""
    model = tiny_neox()
    pad = int(causal_batch()[0][0, 1])
    old = model.gpt_neox.embed_in
    emb = torch.nn.Embedding(old.num_embeddings, old.embedding_dim, padding_idx=pad)
    with torch.no_grad():
        emb.weight.copy_(old.weight)
    model.gpt_neox.embed_in = emb
    settings = TrackSettings(rank=0, k_in=10_000, k_out=10_000, embedding="on")
    store, layers = check_causal(tmp_path, model, settings)
    assert layers[0].module is emb
    rec = store.sketches(0)  # (B, d, V): unprojected
    assert np.all(rec[0][:, pad] == 0) and np.abs(rec[0]).max() > 0


def test_auto_records_it_only_for_a_full_fine_tune_of_saved_weights(tmp_path):
    built = tiny_neox()  # built from a config: from scratch
    assert embedding_layer(built, TrackSettings()) is None
    loaded = _saved_and_loaded(built, tmp_path)
    assert embedding_layer(loaded, TrackSettings())[0] == EMBED
    assert build_layers(loaded, TrackSettings())[0].kind == "embedding"
    # scope other than 'all', off, and LoRA (the embedding is frozen): none
    assert embedding_layer(loaded, TrackSettings(scope="last-block")) is None
    assert embedding_layer(loaded, TrackSettings(embedding="off")) is None
    lora = get_peft_model(loaded, LoraConfig(r=2, target_modules=["query_key_value"]))
    assert embedding_layer(lora, TrackSettings(embedding="on")) is None
    # 'on' records it from scratch too; a BERT classifier's word embeddings are found by name
    assert embedding_layer(built, TrackSettings(embedding="on"))[0] == EMBED
    bert = tiny_bert_classifier()
    assert embedding_layer(bert, TrackSettings(embedding="on"))[0].endswith("word_embeddings")


def test_bad_embedding_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="embedding must be one of"):
        TrackSettings(embedding="yes")
    with pytest.raises(ConfigError, match="factored sketches"):
        embedding_layer(tiny_neox(), TrackSettings(embedding="on", sketch="dense"))
    # a run recorded before the setting existed read as off
    assert TrackSettings.from_dict({}).embedding.value == "off"
    assert TrackSettings().to_dict()["embedding"] == "auto"


def test_a_run_with_an_embedding_record_is_queried_through_it(tmp_path):
    """An own loop on saved weights (auto records the embedding), finished and opened: the
    query's embedding sketch is the final model's autograd gradient through the stored P_in,
    and identity scores are the lr-weighted inner products over every layer, embedding included."""
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.settings import IndexSettings
    from traceprop_engine.training.losses import causal_lm_losses

    model = _saved_and_loaded(tiny_neox(), tmp_path)
    rows = [
        torch.randint(1, 97, (6,), generator=torch.Generator().manual_seed(i)) for i in range(6)
    ]
    model.train()
    settings = TrackSettings(k_in=8, k_out=8, covariance_stride=1)
    run = open_run(train_own_loop(model, tmp_path / "run", settings, rows))
    assert run.store.layers[0].name == EMBED and run.store.layers[0].kind == "embedding"
    query = rows[1].tolist()
    enc, _, _ = run.encode(input_ids=query)
    sk, _ = run.query_sketches(enc)
    final = run.model().model
    emb = next(m for n, m in final.named_modules() if n == EMBED)
    final.zero_grad()
    q = torch.tensor([query])
    causal_lm_losses(final(input_ids=q).logits, q)[0].backward()
    G = emb.weight.grad.T.double().numpy()
    p_in, p_out = run.store.projection(0, "in"), run.store.projection(0, "out")
    p_out = np.eye(G.shape[0]) if p_out is None else p_out
    assert_close(sk[0][0], p_out @ G @ p_in.T, "query sketch of the embedding")
    ident = IndexSettings(preconditioner="identity", cosine=False)
    s = run.scores(input_ids=query, settings=ident)
    rec = run.store.records()
    weight = reference_record_weights(rec)  # the default: the last epoch's records
    want = np.zeros(6)
    for r in range(run.store.n_records):
        dot = sum(
            float(np.dot(sk[li].ravel(), run.store.sketches(li, r, r + 1).ravel()))
            for li in range(len(run.store.layers))
        )
        want[rec[C.REC_EXAMPLE][r]] += weight[r] * dot
    np.testing.assert_allclose(s, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    # the default (K-FAC) answers too, with the embedding's statistics
    assert np.all(np.isfinite(run.scores(input_ids=query)))


@pytest.mark.parametrize("recorded", ["on", "off"])
def test_auto_is_decided_once_per_run_and_a_resume_follows_the_store(tmp_path, recorded):
    """The Tracker resolves auto at the start (by the model) and on a resume by what the store
    records: the resumed model comes from saved weights, which auto alone would take for a
    pretrained one."""
    from traceprop_engine.capture.layers import resolved_embedding
    from traceprop_engine.store.writer import StoreWriter

    built = tiny_neox()
    assert resolved_embedding(TrackSettings(), built, None).embedding.value == "off"
    loaded = _saved_and_loaded(built, tmp_path)
    assert resolved_embedding(TrackSettings(), loaded, None).embedding.value == "on"
    path = tmp_path / "store.h5"
    store, _ = record_causal_step(path, tiny_neox(), TrackSettings(embedding=recorded))
    norms = [store.sq_norm_sum(i) for i in range(len(store.layers))]
    n = store.n_records
    store.close()
    writer = StoreWriter.reopen(path, n, norms)
    try:
        got = resolved_embedding(TrackSettings(), loaded, writer.layer_kinds).embedding.value
    finally:
        writer.close(C.STATUS_COMPLETED)
    assert got == recorded
    # an explicit setting is kept as given
    assert resolved_embedding(TrackSettings(embedding="off"), loaded, None).embedding.value == "off"


class _ScaledEmbedding(torch.nn.Embedding):
    """Gemma's and BART's scaled word embeddings: the rows times a scalar embed_scale."""

    def __init__(self, base: torch.nn.Embedding, scale):
        super().__init__(base.num_embeddings, base.embedding_dim)
        with torch.no_grad():
            self.weight.copy_(base.weight)
        self.embed_scale = scale

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class _OtherEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return torch.tanh(super().forward(ids))


@pytest.mark.parametrize("scale", [3.0, torch.tensor(0.5)])
def test_a_scaled_embedding_records_its_scaled_gradient(tmp_path, scale):
    model = tiny_neox()
    model.gpt_neox.embed_in = _ScaledEmbedding(model.gpt_neox.embed_in, scale)
    _, layers = check_causal(
        tmp_path, model, TrackSettings(rank=0, k_in=4, k_out=6, embedding="on")
    )
    assert layers[0].kind == "embedding"


def test_embeddings_auto_cannot_follow_are_skipped_and_on_says_why(tmp_path):
    loaded = _saved_and_loaded(tiny_neox(), tmp_path)
    old = loaded.gpt_neox.embed_in
    loaded.gpt_neox.embed_in = _OtherEmbedding(old.num_embeddings, old.embedding_dim)
    assert embedding_layer(loaded, TrackSettings()) is None
    with pytest.raises(ConfigError, match="scales its output in a forward"):
        embedding_layer(loaded, TrackSettings(embedding="on"))
    loaded.gpt_neox.embed_in = torch.nn.Embedding(
        old.num_embeddings, old.embedding_dim, scale_grad_by_freq=True
    )
    assert embedding_layer(loaded, TrackSettings()) is None
    with pytest.raises(ConfigError, match="scale_grad_by_freq"):
        embedding_layer(loaded, TrackSettings(embedding="on"))


def test_auto_leaves_out_an_embedding_tied_to_the_lm_head(tmp_path):
    """GPT-2 ties lm_head.weight to wte.weight: auto does not add a second record of that
    parameter (unmeasured); 'on' still records it."""
    from helpers import tiny_gpt2
    from transformers import GPT2LMHeadModel

    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    gpt2 = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert embedding_layer(gpt2, TrackSettings()) is None
    assert embedding_layer(gpt2, TrackSettings(embedding="on"))[0] == "transformer.wte"


def test_the_manifest_records_what_auto_decided_and_a_silent_embedding_is_named(tmp_path, caplog):
    from traceprop_engine import Tracker
    from traceprop_engine.training.losses import causal_lm_losses

    loaded = _saved_and_loaded(tiny_neox(), tmp_path)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    with Tracker(loaded, tmp_path / "s.h5", TrackSettings(k_in=8, k_out=8)) as tr:
        assert tr.settings.embedding.value == "on"
        assert tr.tracking_manifest()["embedding"] == "on"
        with tr.step([0, 1], step=0) as rec:  # called with inputs_embeds: the hook never runs
            emb = loaded.gpt_neox.embed_in(ids).detach()
            rec.losses = causal_lm_losses(loaded(inputs_embeds=emb).logits, ids)
            rec.losses.mean().backward()
    assert "took no part in a step" in caplog.text
    with Tracker(tiny_neox(), tmp_path / "t.h5", TrackSettings(k_in=8, k_out=8)) as tr:
        assert tr.tracking_manifest()["embedding"] == "off"
