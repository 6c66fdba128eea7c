"""Index builds are atomic and locked, a damaged index is never used, rankings follow the sign
of the score, and CSV exports cannot carry spreadsheet formulas (issue 10, items 1-3, 11, 12)."""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import facts_data, fast_settings, reference_record_weights

from traceprop_engine import IndexBuildError, RunError
from traceprop_engine.attribution.index.run_indexes import IDS_FILE, VECTORS_FILE
from traceprop_engine.attribution.precondition import vectors as vectors_module
from traceprop_engine.attribution.query import open_run
from traceprop_engine.attribution.reports.audit import audit_trail
from traceprop_engine.attribution.reports.export import csv_bytes, rows_to_bytes
from traceprop_engine.cli.main import main
from traceprop_engine.settings import IndexSettings
from traceprop_engine.training.loop import train

REPO = Path(__file__).resolve().parents[2]
IDENTITY = IndexSettings(preconditioner="identity", cosine=False)
INDEX_FILES = ("index.json", "index.faiss", VECTORS_FILE, IDS_FILE, "preconditioner.npz")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = facts_data(tmp_path_factory.mktemp("data"))
    # a hostile source file: its name and its rows start with spreadsheet formula characters
    rows = [
        {"prompt": '=HYPERLINK("http://x")\nA:', "completion": " one"},
        {"prompt": "+1+2\nA:", "completion": " two"},
        {"prompt": "-3+4\nA:", "completion": " three"},
        {"prompt": "@SUM(A1)\nA:", "completion": " four"},
        {"prompt": "\tTAB\nA:", "completion": " five"},
    ]
    (root / "train" / "=HYPERLINK(1).jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory):
    return train(fast_settings(data, tmp_path_factory.mktemp("runs") / "r", tiny_width=64))


def brute_force_vectors(run) -> tuple[np.ndarray, np.ndarray]:
    """Σ_records w_r·Ŝ_r per training example (``w_r``: the default records' weights, the last
    epoch's), all layers flattened and concatenated (the identity-preconditioned vectors),
    computed directly from the store in float64."""
    rec = run.store.records()
    weight = reference_record_weights(rec)
    ids = np.unique(rec["example_index"])
    row = {int(e): i for i, e in enumerate(ids)}
    parts = []
    for li in range(len(run.store.layers)):
        x = run.store.sketches(li).astype(np.float64).reshape(run.store.n_records, -1)
        acc = np.zeros((len(ids), x.shape[1]))
        for r, e in enumerate(rec["example_index"]):
            acc[row[int(e)]] += weight[r] * x[r]
        parts.append(acc)
    return ids, np.concatenate(parts, axis=1)


def assert_index_correct(run_dir: Path) -> None:
    run = open_run(run_dir)
    index, ids, _ = run.index(IDENTITY)
    ref_ids, ref = brute_force_vectors(run)
    assert index.n == len(ids) == len(ref_ids)
    np.testing.assert_array_equal(ids, ref_ids)
    vec = np.load(run_dir / "index" / IDENTITY.name / VECTORS_FILE)
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(vec, ref, rtol=1e-4, atol=tol)
    # the FAISS index holds the same vectors: its scores equal a brute-force computation
    q = ref[3].astype(np.float32)
    scores, got = index.search(q, 5)
    want = ref @ ref[3]
    order = np.argsort(-want)[:5]
    np.testing.assert_allclose(scores[0], want[order], rtol=1e-4, atol=tol * np.abs(q).max())
    assert set(got[0].tolist()) == set(order.tolist())
    run.close()


def leftovers(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "index").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def snapshot(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in INDEX_FILES}


_BUILDER = """
import sys, time
from pathlib import Path
from traceprop_engine.attribution.query import open_run
from traceprop_engine.settings import IndexSettings
run = open_run(sys.argv[1])
go = Path(sys.argv[2])
Path(sys.argv[3]).touch()
while not go.exists():
    time.sleep(0.001)
run.index(IndexSettings(preconditioner="identity", cosine=False), rebuild=True)
"""


# -- items 1 and 2: atomic, locked builds; damaged indexes are not used ---------------------------
@pytest.mark.slow
def test_concurrent_builds_end_with_a_correct_index(run_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(3):
        go = tmp_path / f"go{round_}"
        ready = [tmp_path / f"ready{round_}-{i}" for i in range(2)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _BUILDER, str(run_dir), str(go), str(r)],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in ready
        ]
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()  # both processes start building at the same moment
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        assert_index_correct(run_dir)
        assert leftovers(run_dir) == []


@pytest.mark.parametrize("damage", ["zeroed", "truncated", "faiss-zeroed"])
def test_damaged_index_is_detected_and_rebuilt(run_dir, damage, caplog):
    d = run_dir / "index" / IDENTITY.name
    open_run(run_dir).index(IDENTITY, rebuild=True)
    good = np.load(d / VECTORS_FILE)
    name = "index.faiss" if damage == "faiss-zeroed" else VECTORS_FILE
    size = (d / name).stat().st_size
    with open(d / name, "r+b") as f:
        if damage == "truncated":
            f.truncate(size // 2)
        else:  # what an interrupted in-place rebuild used to leave: same size, zeros
            f.seek(128)
            f.write(b"\0" * (size - 128))
    run = open_run(run_dir)
    index, _, _ = run.index(IDENTITY)
    assert "changed or damaged" in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_allclose(np.load(d / VECTORS_FILE), good, rtol=1e-6, atol=0)
    assert float(np.abs(run.all_scores(good[:1], IDENTITY)).max()) > 0
    assert_index_correct(run_dir)


def test_indexes_with_another_projection_side_keep_their_own_folder(run_dir, caplog):
    """Two index projections of one run (IndexSettings.index_side) used to share a folder and a
    cache entry: building one evicted the other and a query could read the other's vectors."""
    small = IndexSettings(preconditioner="identity", cosine=False, index_side=2)
    run = open_run(run_dir)
    run.index(IDENTITY)
    run.index(small)
    assert run.indexes.dir(small) != run.indexes.dir(IDENTITY)
    n_layers = len(run.store.layers)
    assert (
        run.indexes.vectors(small).shape[1] <= 4 * n_layers < run.indexes.vectors(IDENTITY).shape[1]
    )
    caplog.clear()
    fresh = open_run(run_dir)  # both load from disk: neither was overwritten by the other
    fresh.index(IDENTITY)
    fresh.index(small)
    assert "rebuilding" not in caplog.text
    assert fresh.indexes.vectors(small).shape == run.indexes.vectors(small).shape


def test_interrupted_rebuild_leaves_the_previous_index(run_dir, monkeypatch):
    d = run_dir / "index" / IDENTITY.name
    open_run(run_dir).index(IDENTITY, rebuild=True)
    before = snapshot(d)
    monkeypatch.setattr(vectors_module, "CHUNK", 8)  # the vectors are written in several chunks

    def interrupt(stage, done, total):
        if stage == "vectors":
            raise KeyboardInterrupt  # what Ctrl-C does in the middle of writing the vectors

    with pytest.raises(KeyboardInterrupt):
        open_run(run_dir).index(IDENTITY, rebuild=True, progress=interrupt)
    assert snapshot(d) == before
    assert leftovers(run_dir) == []
    run = open_run(run_dir)
    run.build_index = None  # the previous index is complete and fresh: loaded, not rebuilt
    run.index(IDENTITY)
    assert_index_correct(run_dir)


# -- item 11: a full disk ends with a clear message and the previous index intact -----------------
@pytest.mark.parametrize("where", ["np.save", "posix_fallocate"])
def test_full_disk_while_indexing_keeps_the_previous_index(run_dir, where, monkeypatch, capsys):
    d = run_dir / "index" / IDENTITY.name
    open_run(run_dir).index(IDENTITY, rebuild=True)
    before = snapshot(d)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "np.save":
        monkeypatch.setattr(np, "save", no_space)
    else:
        monkeypatch.setattr(os, "posix_fallocate", no_space)
    rc = main(["index", str(run_dir), "--preconditioner", "identity", "--rebuild"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "No space left on device" in err and "free disk space" in err
    assert "left as it was" in err and "Traceback" not in err
    assert snapshot(d) == before
    assert leftovers(run_dir) == []
    with pytest.raises(IndexBuildError, match="No space left"):
        open_run(run_dir).build_index(IDENTITY)
    monkeypatch.undo()
    assert_index_correct(run_dir)


# -- round 2, "silently wrong" item 5: an index folder that links outside the run -----------------
@pytest.mark.parametrize("link", ["index", f"index/{IDENTITY.name}"])
def test_an_index_folder_that_is_a_link_is_refused(run_dir, tmp_path, link, capsys):
    """``index`` used to build the whole index in the link's target (``train`` refuses links)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("index"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(outside, target_is_directory=True)
    rc = main(["index", str(run), "--preconditioner", "identity", "--no-cosine"])
    err = capsys.readouterr().err
    assert rc == 1 and "is a symbolic link" in err and "Traceback" not in err
    assert list(outside.iterdir()) == []  # nothing written through the link
    with pytest.raises(RunError, match="symbolic link"):
        open_run(run).index(IDENTITY)


# -- item 3: proponents have score > 0, opponents < 0, an example in at most one list --------------
def check_signs(res, scores_by_example: dict[int, float], top_k: int) -> None:
    pro, opp = res.proponents, res.opponents
    assert (pro["score"] > 0).all() and (opp["score"] < 0).all()
    assert not set(pro["example_id"]) & set(opp["example_id"])
    n_pos = sum(v > 0 for v in scores_by_example.values())
    n_neg = sum(v < 0 for v in scores_by_example.values())
    assert pro.height == min(top_k, n_pos) and opp.height == min(top_k, n_neg)
    assert pro["rank"].to_list() == list(range(1, pro.height + 1))
    assert opp["rank"].to_list() == list(range(1, opp.height + 1))
    for r in res.rows.iter_rows(named=True):
        assert r["score"] == pytest.approx(scores_by_example[r["example_id"]], rel=1e-5, abs=1e-7)


def test_labels_follow_the_sign_when_top_k_exceeds_the_signed_scores(run_dir, tmp_path, capsys):
    run = open_run(run_dir)
    ev = int(run.eval_examples()["example_id"][0])
    res = run.query(eval_example=ev, top_k=1000, settings=IDENTITY)
    _, ids, pre = run.index(IDENTITY)
    scores = dict(
        zip(ids.tolist(), run.all_scores(pre.apply(res.sketches), IDENTITY).tolist(), strict=True)
    )
    n_pos = sum(v > 0 for v in scores.values())
    assert 0 < n_pos < len(scores)  # both signs occur: the old code mislabelled the tails
    check_signs(res, scores, 1000)
    assert any(f"{n_pos} proponents of the 1000 asked" in n for n in res.notes)
    # the audit trail (CLI `audit`, the app's Audit page) takes its rows from the same result
    kinds = {(i["kind"], i["example_id"]) for i in audit_trail(run, res)["influencers"]}
    assert all((scores[e] > 0) == (k == "proponent") for k, e in kinds)
    # the CLI `query --opponents` prints and exports those rows and says that there are fewer
    out_csv = tmp_path / "q.csv"
    rc = main(
        [
            "query",
            str(run_dir),
            "--eval-example",
            str(ev),
            "--top-k",
            "1000",
            "--opponents",
            "--preconditioner",
            "identity",
            "--csv",
            str(out_csv),
        ]
    )
    assert rc == 0
    assert f"note: {n_pos} proponents of the 1000 asked" in capsys.readouterr().err
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert len(rows) == sum(v != 0 for v in scores.values())
    for r in rows:
        assert (float(r["score"]) > 0) == (r["kind"] == "proponent")


# -- item 12: CSV formula injection ---------------------------------------------------------------
DANGEROUS = ("=", "+", "-", "@", "\t", "\r")


def assert_no_formula(cells) -> None:
    for c in cells:
        if isinstance(c, str) and c and not _is_number(c):
            assert not c.startswith(DANGEROUS), repr(c)


def _is_number(c: str) -> bool:
    try:
        float(c)
    except ValueError:
        return False
    return True


def test_csv_safe_prefixes_formula_cells_and_json_stays_exact():
    import polars as pl

    df = pl.DataFrame(
        {
            "text": ["=1+1", "+x", "-y", "@z", "\tq", "\rr", "a=b", "plain", None],
            "score": [-1.5, 2.0, -0.25, 0, 1, 2, 3, 4, 5],
        }
    )
    got = list(csv.reader(io.StringIO(csv_bytes(df).decode(), newline="")))
    assert [r[0] for r in got[1:]] == [
        "'=1+1",
        "'+x",
        "'-y",
        "'@z",
        "'\tq",
        "'\rr",
        "a=b",
        "plain",
        "",
    ]
    assert got[1][1] == "-1.5"  # numbers are not text: a negative score stays a number
    assert json.loads(rows_to_bytes(df, "json"))[0]["text"] == "=1+1"


def test_every_csv_export_neutralises_formulas(run_dir, tmp_path):
    run = open_run(run_dir)
    src = "=HYPERLINK(1).jsonl"
    hostile = run.examples().filter(run.examples()["source"] == src)
    assert hostile.height == 5
    e = int(hostile["example_id"][0])
    res = run.query(eval_example=e, top_k=1000, settings=IDENTITY)
    assert src in res.rows["source"].to_list()
    # query CSV (CLI --csv and the app's download share rows_to_bytes)
    q = list(csv.DictReader(io.StringIO(rows_to_bytes(res.rows, "csv").decode())))
    assert {r["source"] for r in q} >= {"'" + src}
    assert any(r["text"].startswith("'=HYPERLINK") for r in q)
    for r in q:
        assert_no_formula(r.values())
    assert src in {r["source"] for r in json.loads(rows_to_bytes(res.rows, "json"))}
    # audit CSV through the CLI
    trail, audit_csv = tmp_path / "a.json", tmp_path / "a.csv"
    assert (
        main(
            [
                "audit",
                str(run_dir),
                "--eval-example",
                str(e),
                "--top-k",
                "1000",
                "--preconditioner",
                "identity",
                "--out",
                str(trail),
                "--csv",
                str(audit_csv),
            ]
        )
        == 0
    )
    a = list(csv.DictReader(io.StringIO(audit_csv.read_text())))
    assert "'" + src in {r["source"] for r in a}
    for r in a:
        assert_no_formula(r.values())
    assert src in {i["source"] for i in json.loads(trail.read_text())["influencers"]}
    # rank CSV
    rank_csv = tmp_path / "r.csv"
    assert main(["rank", str(run_dir), "--by", "loss", "--csv", str(rank_csv)]) == 0
    rk = list(csv.DictReader(io.StringIO(rank_csv.read_text())))
    assert "'" + src in {r["source"] for r in rk}
    for r in rk:
        assert_no_formula(r.values())


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


@pytest.mark.parametrize("settings", [IndexSettings(), IndexSettings(preconditioner="kfac")])
def test_querying_a_run_with_shipped_indexes_writes_nothing_into_it(tmp_path, settings):
    """Issue 27 item 6: a bundled run ships its indexes without lock files; a query used to
    create ``index/.<name>.lock`` in it. Readers take a lock only where a builder made one."""
    import shutil

    run_dir = tmp_path / "facts"
    shutil.copytree(
        REPO / "sample_runs" / "facts", run_dir, ignore=shutil.ignore_patterns(".*.lock")
    )
    before = _snapshot(run_dir)
    res = open_run(run_dir).query(
        "Q: What colour is the planet Ethmor?\nA:", " violet", top_k=3, settings=settings
    )
    assert len(res.proponents) == 3
    assert _snapshot(run_dir) == before


def test_an_index_a_bundled_run_lacks_is_built_in_the_user_cache(tmp_path, monkeypatch):
    """Issue 27 item 6: bundled runs are read-only for every command and page. A query whose
    index the sample does not ship (EK-FAC by dot product) builds it in the user's cache, not
    in ``sample_runs/``; the next query reuses it; only an explicit refit (``rebuild``, what
    ``traceprop index --rebuild`` and ``traceprop sample`` do) writes into the bundled run."""
    import shutil

    bundled = tmp_path / "bundled"
    shutil.copytree(
        REPO / "sample_runs" / "facts",
        bundled / "facts",
        ignore=shutil.ignore_patterns(".*.lock"),
    )
    run_dir = bundled / "facts"
    monkeypatch.setenv("TRACEPROP_SAMPLE_RUNS", str(bundled))
    monkeypatch.setenv("TRACEPROP_CACHE_DIR", str(tmp_path / "cache"))
    s = IndexSettings(preconditioner="ekfac", cosine=False)
    assert not (run_dir / "index" / s.name).exists()  # not shipped
    before = _snapshot(run_dir)
    q = ("Q: What colour is the planet Ethmor?\nA:", " violet")
    first = open_run(run_dir).query(*q, top_k=3, settings=s)
    assert _snapshot(run_dir) == before
    built = list((tmp_path / "cache").glob(f"indexes/*/{s.name}/index.json"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    again = open_run(run_dir).query(*q, top_k=3, settings=s)  # a new process would do the same
    assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert again.rows["example_id"].to_list() == first.rows["example_id"].to_list()
    open_run(run_dir).index(s, rebuild=True)  # the maintainer's refit writes in place
    assert (run_dir / "index" / s.name / "index.json").exists()
