"""The README's "Python API" example runs as written: own loop -> finish -> open_run -> query/scores."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_block() -> str:
    text = README.read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (block,) = [b for b in blocks if "tracker.finish(" in b]
    return block


def test_readme_python_api_example_runs(capsys, tmp_path, monkeypatch):
    # the example's tempfile.mkdtemp() run folder goes under pytest's tmp_path, not /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = python_api_block()
    for needle in (
        "Tracker(",
        "tracker.step(",
        "tracker.finish(model)",
        "open_run(",
        "run.query(input_ids=",
        "run.scores(",
    ):
        assert needle in code
    ns: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), ns)
    run, scores = ns["run"], ns["scores"]
    assert scores.shape == (len(ns["examples"]),)
    assert run.manifest.status == "completed"
    res = ns["res"]
    # the top 3 of each sign: as many of the 6 examples as score above / below 0, at most 3 (the
    # six texts share their words, and the LM-bias term of a run trained on text lifts them all:
    # there may be no opponent)
    n_pos, n_neg = int((scores > 0).sum()), int((scores < 0).sum())
    assert res.proponents.height == min(3, n_pos) >= 1
    assert res.opponents.height == min(3, n_neg)
    assert (res.proponents["score"] > 0).all() and (res.opponents["score"] < 0).all()
    assert res.query["lm_bias"] > 0 and res.layer_names[-1] == "LM bias"
    # the index's top proponent is the exact scores' best (to float32 round-off: a near tie
    # may put another example first)
    top = int(res.proponents["example_id"][0])
    assert scores[top] == pytest.approx(scores.max(), rel=1e-5)
    assert "rank" in capsys.readouterr().out


@pytest.mark.slow
def test_readme_query_worker_example_runs(monkeypatch):
    """The querying example, then the query worker's: the worker's test side ranks the same."""
    text = README.read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (query,) = [b for b in blocks if 'open_run("sample_runs/facts")' in b]
    (worker,) = [b for b in blocks if "QueryWorker(" in b]
    monkeypatch.chdir(README.parent)  # the examples' relative path to the sample run
    ns: dict = {"__name__": "readme_example"}
    exec(compile(query + worker, "README.md", "exec"), ns)  # noqa: S102 - the README's own code
    direct = ns["run"].query(eval_example=154, top_k=10)
    assert ns["res"].rows.equals(direct.rows)
    assert not ns["worker"].alive  # the with block stopped it
