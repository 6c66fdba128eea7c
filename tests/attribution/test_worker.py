"""The query worker (attribution/model_side/worker.py): a real process holding the run's model,
against the same work done in this process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_ranking

from traceprop_engine.attribution.model_side.answer import model_answer
from traceprop_engine.attribution.model_side.tokens import token_contributions
from traceprop_engine.attribution.model_side.worker import QueryWorker, WorkerUnavailable
from traceprop_engine.attribution.query import open_run
from traceprop_engine.errors import QueryError, RunError
from traceprop_engine.settings import IndexSettings

pytestmark = pytest.mark.slow  # query worker processes (each imports torch)

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_runs" / "facts"
SKETCH_RTOL = 1e-6  # float32 sketches of the same model and query in two processes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("worker") / "facts"
    shutil.copytree(SAMPLE, d)  # its index is built here, not in the repository
    return d


@pytest.fixture(scope="module")
def worker(run_dir):
    with QueryWorker(warm=(str(run_dir),)) as w:
        yield w


def test_the_worker_gives_what_this_process_gives(worker, run_dir):
    run = open_run(run_dir)
    eid = int(run.eval_examples()["example_id"][0])
    here = run.test_side(eval_example=eid)
    there = worker.call("test_side", run_dir, eval_example=eid)
    assert there.query == here.query and there.notes == here.notes
    assert there.loss == pytest.approx(here.loss, rel=SKETCH_RTOL)
    for a, b in zip(there.sketches, here.sketches, strict=True):
        np.testing.assert_allclose(a, b, rtol=SKETCH_RTOL, atol=1e-9)
    # ranked here from the worker's test side: the query's own rows and scores
    ranked = run.query(eval_example=eid, top_k=5)
    from_worker = run.query(top_k=5, test_side=there)
    # the worker's sketches agree to SKETCH_RTOL (another process, maybe other thread counts):
    # near-tied scores may come in either order
    np.testing.assert_allclose(from_worker.rows["score"], ranked.rows["score"], rtol=1e-5)
    for side in ("proponents", "opponents"):
        a, b = getattr(from_worker, side), getattr(ranked, side)
        atol = 1e-5 * float(np.abs(b["score"].to_numpy()).max())
        assert_same_ranking(a["example_id"], a["score"], b["example_id"], b["score"], atol, side)
    assert from_worker.query == ranked.query | {"query_loss": there.loss}

    typed = dict(prompt="Q: Which colour does the planet Ethmor have?\nA:", completion=" violet")
    assert worker.call("model_answer", run_dir, **typed) == model_answer(run, **typed)
    top = int(ranked.proponents["example_id"][0])
    s = IndexSettings()
    tc = worker.call(
        "token_contributions", run_dir, sketches=ranked.sketches, example_id=top, settings={}
    )
    ref = token_contributions(run, ranked.sketches, top, s)
    np.testing.assert_array_equal(tc.token_ids, ref.token_ids)
    np.testing.assert_allclose(tc.contributions, ref.contributions, rtol=1e-6, atol=1e-9)
    tok = run.model().tokenizer
    ids = [int(t) for t in ref.token_ids]
    assert worker.call("decode", run_dir, ids=ids) == [tok.decode([t]) for t in ids]


def test_errors_come_back_as_raised_and_the_worker_goes_on(worker, run_dir):
    with pytest.raises(QueryError, match="the prompt is empty"):
        worker.call("test_side", run_dir, prompt="   ")
    with pytest.raises(QueryError, match="does not exist"):
        worker.call("model_answer", run_dir, eval_example=10**6)
    with pytest.raises(RunError):  # not a run directory
        worker.call("test_side", run_dir.parent, eval_example=0)
    with pytest.raises(WorkerUnavailable, match="KeyError"):  # no such op: a crash, reported
        worker.call("no-such-op", run_dir)
    assert worker.alive
    assert worker.call("test_side", run_dir, eval_example=0).sketches


def test_a_dead_or_slow_worker_is_reported_and_stopped(run_dir):
    w = QueryWorker().start()
    try:
        with pytest.raises(WorkerUnavailable, match="took over"):  # imports alone take longer
            w.call("warm", run_dir, timeout=0.05)
        assert not w.alive  # stopped: its late reply must not answer the next request
        with pytest.raises(WorkerUnavailable, match="not running"):
            w.call("test_side", run_dir, eval_example=0)
    finally:
        w.close()
    w = QueryWorker().start()
    try:
        os.kill(w.pid, signal.SIGKILL)
        with pytest.raises(WorkerUnavailable):
            w.call("test_side", run_dir, eval_example=0)
        assert not w.alive
    finally:
        w.close()


def test_the_worker_exits_with_its_caller(tmp_path):
    """Its request pipe closes when the caller dies, however it dies: no orphan is left."""
    code = (
        "import sys, time\n"
        "from traceprop_engine.attribution.model_side.worker import QueryWorker\n"
        "w = QueryWorker().start()\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(caller.stdout.readline())
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 60  # it may still be importing torch when the pipe closes
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the worker outlived its caller")


def test_the_caller_imports_no_torch(run_dir):
    """Open, rank from the worker's test side, score every example: numpy, FAISS and h5py only."""
    code = (
        "import sys\n"
        "from traceprop_engine.attribution.model_side.worker import QueryWorker\n"
        "from traceprop_engine.attribution.query import open_run\n"
        f"run = open_run({str(run_dir)!r})\n"
        "with QueryWorker() as w:\n"
        "    ts = w.call('test_side', run.dir, eval_example=0)\n"
        "    res = run.query(test_side=ts)\n"
        "    run.example_scores(res)\n"
        "    w.call('model_answer', run.dir, eval_example=0)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), len(res.rows))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "[]", out.stdout
