"""``verify`` vouches only for what it checked: data beside the run, the model, the store's bytes."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import facts_data, fast_settings

from traceprop_engine import RunError, Store, StoreError
from traceprop_engine.cli.main import main
from traceprop_engine.store.format import DIGEST_ATTR, FULL_DIGEST_ATTR, content_digest
from traceprop_engine.training.loop import train
from traceprop_engine.verify import verify_run


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A completed run at ROOT/run trained on ROOT/data (so data is ../data/... from the run)."""
    root = tmp_path_factory.mktemp("made")
    data = facts_data(root / "data")
    train(fast_settings(data, root / "run"))
    return root


@pytest.fixture
def run(made, tmp_path):
    shutil.copytree(made, tmp_path / "c")
    return tmp_path / "c" / "run"


def _manifest(run):
    return json.loads((run / "run.json").read_text())


def _write_manifest(run, m):
    (run / "run.json").write_text(json.dumps(m))


def test_a_completed_run_verifies_with_its_digest(run):
    with Store(run / "store.h5") as s:
        want = s.attrs()[DIGEST_ATTR]
        assert want == content_digest(s._f) and len(want) == 64
        assert s.fingerprint.endswith(s.attrs()[FULL_DIGEST_ATTR])  # indexes follow the content
        assert s._f["layers/000/U"].fletcher32 and s._f["layers/000/V"].fletcher32
    rep = verify_run(run)
    assert rep["ok"], rep["problems"]
    assert rep["store"]["status"] == "ok" and rep["problems"] == []
    assert rep["roots"]["root"] == str((run.parent / "data" / "train").resolve())


def test_flipped_bytes_in_a_sketch_fail_verify_and_reads(run):
    with h5py.File(run / "store.h5", "r") as f:
        info = f["layers/000/U"].id.get_chunk_info(0)  # the default: rank-1 factors
    with open(run / "store.h5", "r+b") as fh:
        fh.seek(info.byte_offset + 8)
        chunk = bytearray(fh.read(16))
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "unreadable"
    assert any("store is unreadable" in p for p in rep["problems"])
    with Store(run / "store.h5") as s, pytest.raises(StoreError, match="damaged"):
        s.sketches(0)


@pytest.mark.parametrize("cached", [True, False], ids=["record-cache", "small-store"])
def test_flipped_bytes_after_the_index_was_built_never_reach_an_answer(
    run, capsys, monkeypatch, cached
):
    """The index was built before the damage and its fingerprint (which holds the recorded
    digest) still matches. With a record cache (stores from record_cache.MIN_RECORDS records) a
    query answers from the index's own copy of the records (made from the intact store, checked
    against index.json's digests on load): the same scores as before the damage. A small store
    has no copy: the query reads the store and stops with "damaged". Never damaged numbers.
    `verify` and `index --rebuild` stop with "damaged"."""
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.attribution.score import record_cache

    monkeypatch.setattr(record_cache, "MIN_RECORDS", 0 if cached else 10**9)
    first = open_run(run)
    before = first.query("Where does Ada live?", " Paris", top_k=3)
    first.close()
    assert before.rows.height > 0  # the index and its record copy exist now
    with h5py.File(run / "store.h5", "r") as f:
        info = f["layers/000/U"].id.get_chunk_info(0)
    with open(run / "store.h5", "r+b") as fh:
        fh.seek(info.byte_offset + 8)
        chunk = bytearray(fh.read(16))
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    again = open_run(run)
    try:
        if cached:
            after = again.query("Where does Ada live?", " Paris", top_k=3)
        else:
            with pytest.raises(StoreError, match="damaged"):
                again.query("Where does Ada live?", " Paris", top_k=3)
    finally:
        again.close()
    if cached:
        assert after.rows["example_id"].to_list() == before.rows["example_id"].to_list()
        np.testing.assert_array_equal(
            after.rows["score"].to_numpy(), before.rows["score"].to_numpy()
        )
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "unreadable"
    capsys.readouterr()
    assert main(["index", str(run), "--rebuild"]) != 0
    assert "damaged" in capsys.readouterr().err


def test_a_rewritten_sketch_value_changes_the_digest(run):
    # written through HDF5 (so the chunk checksum is recomputed): only the digest can tell
    with h5py.File(run / "store.h5", "r+") as f:
        f["layers/000/U"][0, 0, 0] += 1  # one bfloat16 ulp
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "changed"


@pytest.mark.parametrize("attr", [DIGEST_ATTR, FULL_DIGEST_ATTR])
def test_a_removed_digest_on_a_checksummed_store_is_not_vouched_for(run, attr):
    with h5py.File(run / "store.h5", "r+") as f:
        del f.attrs[attr]
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "absent"
    assert attr in rep["store"]["files"][0]["detail"]


# -- round 2, "silently wrong" item 2: what a score or a lineage claim depends on is covered ------
def _rewrite_p_out(f):
    f["layers/000/P_out"][0, :16] += 0.5  # 64 bytes (the case that moved the top score)


def _rewrite_lineage(f):
    g = f["examples"]
    g["source"][0] = "elsewhere.jsonl"
    g["row"][0] = g["row"][0] + 7


def _rewrite_tokens(f):
    f["examples/tokens"][1] = f["examples/tokens"][1] + 1


def _rewrite_cov_tokens(f):
    g = f["layers/000"]
    g.attrs["cov_tokens"] = float(g.attrs["cov_tokens"]) * 2  # the damping's scale


def _rewrite_model_origin(f):
    f.attrs["model_origin"] = "pretrained-full"  # would turn the default index to fisher


@pytest.mark.parametrize(
    "rewrite",
    [_rewrite_p_out, _rewrite_lineage, _rewrite_tokens, _rewrite_cov_tokens, _rewrite_model_origin],
)
def test_a_rewritten_projection_or_example_table_is_not_vouched_for(run, rewrite):
    """Written through HDF5 (the chunk checksums are recomputed): used to verify as unchanged."""
    with h5py.File(run / "store.h5", "r+") as f:
        assert f["layers/000/P_out"].fletcher32 and f["examples/row"].fletcher32
        rewrite(f)
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "changed"
    assert rep["store"]["files"][0]["digest_version"] == 2
    if rewrite is _rewrite_lineage:  # the text columns are checked on every read, too
        with Store(run / "store.h5") as s, pytest.raises(StoreError, match="no longer match"):
            s.examples()


def test_flipped_bytes_in_a_projection_fail_verify_and_reads(run):
    with h5py.File(run / "store.h5", "r") as f:
        info = f["layers/000/P_out"].id.get_chunk_info(0)
    with open(run / "store.h5", "r+b") as fh:
        fh.seek(info.byte_offset + 8)
        chunk = fh.read(64)
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    with Store(run / "store.h5") as s, pytest.raises(StoreError, match="P_out .* is damaged"):
        s.projection(0, "out")
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "unreadable"


def test_a_truncated_store_fails(run):
    p = run / "store.h5"
    size = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.truncate(size // 2)
    rep = verify_run(run)
    assert not rep["ok"] and rep["store"]["status"] == "unreadable"


def test_a_killed_run_without_a_model_fails(run):
    m = _manifest(run)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    m.update(status="running", pid=p.pid, host=platform.node())
    del m["model"]["fingerprint"]
    _write_manifest(run, m)
    shutil.rmtree(run / "model")
    rep = verify_run(run)
    assert not rep["ok"] and rep["model"]["status"] == "absent"
    assert any("'failed'" in p and "cannot vouch" in p for p in rep["problems"])


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_a_run_that_did_not_complete_is_not_vouched_for(run, status):
    m = _manifest(run)
    m["status"] = status
    _write_manifest(run, m)
    rep = verify_run(run)
    assert not rep["ok"] and "cannot vouch" in rep["problems"][0]


def test_an_empty_manifest_fails_and_a_list_is_an_error(run, capsys):
    (run / "run.json").write_text("{}")
    rep = verify_run(run)
    assert not rep["ok"]
    assert any("no training data files" in p for p in rep["problems"])
    assert main(["verify", str(run)]) == 3
    assert "NOT VERIFIED" in capsys.readouterr().out
    (run / "run.json").write_text("[1, 2]")
    with pytest.raises(RunError, match="JSON list, not a run manifest"):
        verify_run(run)
    assert main(["verify", str(run)]) == 1
    assert "error:" in capsys.readouterr().err


def test_a_moved_run_checks_the_data_beside_it(made, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(made, moved)
    # the manifest's absolute data path still points at the original copy, which is unchanged
    assert (made / "data" / "train").is_dir()
    f = next((moved / "data" / "train").glob("*.jsonl"))
    f.write_text(f.read_text().replace("A", "B", 1))
    rep = verify_run(moved / "run")
    changed = [x for x in rep["files"] if x["status"] == "changed"]
    assert not rep["ok"] and [x["file"] for x in changed] == [str(f.resolve())]
    assert main(["verify", str(moved / "run")]) == 3
    assert f"data files under {(moved / 'data' / 'train').resolve()}" in capsys.readouterr().out


def test_recorded_files_that_are_gone_fail(run):
    for p in (run.parent / "data" / "eval").iterdir():
        p.unlink()
    m = _manifest(run)
    m["data"]["eval_root"] = str(run.parent / "nowhere")
    _write_manifest(run, m)
    rep = verify_run(run)
    missing = [x for x in rep["files"] if x["status"] == "missing"]
    assert not rep["ok"] and len(missing) == len(m["data"]["eval_files"]) >= 1


def test_the_committed_sample_verifies_with_its_digest():
    from traceprop_engine.samples.run import default_root

    rep = verify_run(default_root() / "facts")
    assert rep["ok"] and rep["store"]["status"] == "ok"
    assert np.all([x["status"] == "ok" for x in rep["files"]])
    (store,) = rep["store"]["files"]
    assert store["digest_version"] == 2  # regenerated after content_sha256_v2
    with Store(default_root() / "facts" / "store.h5") as s:
        assert len(s.examples()["source"]) == s.n_examples > 0


def _as_written_before_the_full_digest(f: h5py.File) -> None:
    """What a store written before ``content_sha256_v2`` looks like: no such attribute, and its
    projections and example rows stored without chunk checksums."""
    del f.attrs[FULL_DIGEST_ATTR]
    groups = [f["layers"][k] for k in f["layers"]] + [f["examples"]]
    for g in groups:
        for name in ("P_in", "P_out", "dense_index", "row"):
            if name in g and g[name].fletcher32:
                data, attrs = g[name][()], dict(g[name].attrs)
                del g[name]
                g.create_dataset(name, data=data).attrs.update(attrs)


def test_a_store_from_before_the_full_digest_verifies_with_its_older_one(run, capsys):
    """A store written before ``content_sha256_v2`` (the bundled sample was one until stop 35)
    opens, verifies its ``content_sha256`` and says what that digest does not cover."""
    with h5py.File(run / "store.h5", "r+") as f:
        _as_written_before_the_full_digest(f)
    rep = verify_run(run)
    assert rep["ok"] and rep["store"]["status"] == "ok"
    (store,) = rep["store"]["files"]
    assert store["digest_version"] == 1 and "not the projection matrices" in store["detail"]
    capsys.readouterr()
    assert main(["verify", str(run)]) == 0
    assert "in what the store's older digest covers" in capsys.readouterr().out
    with h5py.File(run / "store.h5", "r+") as f:  # the older digest still catches a change
        f["layers/000/U"][0] = f["layers/000/U"][0] + 1
    assert verify_run(run)["store"]["status"] == "changed"


def test_library_versions_are_the_modules_and_import_nothing():
    """run.json and audit trails record the libraries' versions; reading them imports no torch
    (the app's server writes audit trails without ever importing torch)."""
    code = (
        "import sys, json\n"
        "from traceprop_engine.run import library_versions\n"
        "v = library_versions()\n"
        "print(json.dumps([v, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    v, imported = json.loads(out.stdout)
    assert imported == []
    import faiss
    import h5py
    import numpy
    import torch
    import transformers

    from traceprop_engine.run import library_versions

    want = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "faiss": faiss.__version__,
    }
    assert {k: v[k] for k in want} == want
    assert library_versions() == v  # the same once they are imported


# -- round 2, "silently wrong" item 3: a query runs on the run's own model, and says which ---------
def test_a_swapped_model_is_refused_and_trails_name_the_loaded_model(run, monkeypatch):
    from safetensors.torch import load_file, save_file

    from traceprop_engine import ModelMismatchError
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.attribution.reports.audit import audit_trail
    from traceprop_engine.training import fingerprint
    from traceprop_engine.training.fingerprint import model_fingerprint

    hashed = []
    real = fingerprint.model_fingerprint
    monkeypatch.setattr(fingerprint, "model_fingerprint", lambda d: hashed.append(d) or real(d))
    recorded = _manifest(run)["model"]["fingerprint"]
    for _ in range(2):  # opened twice: hashed once (the files' sizes and times are the same)
        r = open_run(run)
        res = r.query("Where does Ada live?", " Paris", top_k=3)
        trail = audit_trail(r, res)
        r.close()
        assert trail["model_fingerprint"] == recorded == model_fingerprint(run / "model")
        assert trail["recorded_model_fingerprint"] == recorded
    assert len(hashed) == 1
    # another model of the same shape (other weights), as a swapped model/ folder would hold
    (weights,) = (run / "model").glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.numel() > 1)
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    r = open_run(run)
    try:
        with pytest.raises(ModelMismatchError, match="not the one this run saved"):
            r.query("Where does Ada live?", " Paris", top_k=3)
    finally:
        r.close()
    assert len(hashed) == 2  # the changed file was hashed again
    assert not verify_run(run)["ok"]
