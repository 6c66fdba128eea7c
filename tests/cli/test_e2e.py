"""End to end through the CLI: data files -> train -> index -> query -> CSV/JSON with lineage,
audit trail, and verify detecting a one-byte change."""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys

import pytest


def cli(*args, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "traceprop_engine", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"traceprop {' '.join(map(str, args))} -> {p.returncode}\n{p.stderr[-3000:]}"
        )
    return p


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = root / "data"
    (data / "zoo").mkdir(parents=True)
    # JSONL with a blank line (editor line numbers), and a CSV in a sub-folder
    lines = [
        json.dumps(
            {"prompt": f"Q: What does the animal Bix{i} eat?\nA:", "completion": f" food{i % 5}"}
        )
        for i in range(24)
    ]
    lines.insert(5, "")
    (data / "animals.jsonl").write_text("\n".join(lines) + "\n")
    with open(data / "zoo" / "keepers.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for i in range(16):
            w.writerow([f"Q: Who keeps the pen Z{i}?\nA:", f" keeper{i % 3}"])
    run = root / "run"
    cli(
        "train",
        "--data",
        data,
        "--out",
        run,
        "--epochs",
        2,
        "--tiny-layers",
        1,
        "--tiny-width",
        32,
        "--tiny-vocab",
        300,
        "--max-length",
        48,
        "--k-in",
        4,
        "--k-out",
        4,
        "--threads",
        1,
        "--eval-fraction",
        0.1,
    )
    return root, data, run, lines


@pytest.mark.slow
def test_train_index_query_csv_carry_lineage(e2e):
    root, data, run, lines = e2e
    p = cli("index", run)
    assert "vectors" in p.stdout and "index kfac-cos:" in p.stdout  # the default: K-FAC
    out_csv, out_json = root / "top.csv", root / "top.json"
    # identity over all records: on this tiny run K-FAC, and identity over the last epoch's
    # records (the default), score every example of this query above 0, and the export is
    # checked with rows of both signs
    p = cli(
        "query",
        run,
        "--preconditioner",
        "identity",
        "--records",
        "all",
        "--prompt",
        "Q: What does the animal Bix3 eat?\nA:",
        "--completion",
        " food3",
        "--top-k",
        5,
        "--opponents",
        "--csv",
        out_csv,
        "--json",
        out_json,
    )
    assert "proponent" in p.stdout and "score > 0: proponent" in p.stdout
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    js = json.loads(out_json.read_text())
    # by sign: 5 proponents (> 0) and at most 5 opponents (< 0)
    assert len(rows) == len(js) <= 10
    pro = [r for r in rows if r["kind"] == "proponent"]
    assert len(pro) == 5 and all(float(r["score"]) > 0 for r in pro)
    assert all(float(r["score"]) < 0 for r in rows if r["kind"] == "opponent")
    assert {"rank", "score", "example_id", "source", "row", "sha256", "text", "kind"} <= set(
        rows[0]
    )
    assert {r["kind"] for r in rows} == {"proponent", "opponent"}
    for r in rows:
        if r["source"] == "animals.jsonl":
            raw = lines[int(r["row"]) - 1]  # editor line numbers, blank line counted
            assert hashlib.sha256(raw.encode()).hexdigest() == r["sha256"]
            assert json.loads(raw)["prompt"] in r["text"]
        else:
            assert r["source"] == "zoo/keepers.csv" and 1 <= int(r["row"]) <= 16
    scores = [float(r["score"]) for r in rows if r["kind"] == "proponent"]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.slow
def test_audit_and_verify(e2e):
    root, data, run, _ = e2e
    trail = root / "trail.json"
    cli(
        "audit",
        run,
        "--prompt",
        "Q: Who keeps the pen Z2?\nA:",
        "--completion",
        " keeper2",
        "--out",
        trail,
        "--csv",
        root / "trail.csv",
    )
    t = json.loads(trail.read_text())
    assert t["model_fingerprint"] and t["data_manifest_sha256"] and t["influencers"]
    assert {"example_id", "source", "row", "sha256", "score", "rank"} <= set(t["influencers"][0])
    assert cli("verify", run).returncode == 0
    f = data / "zoo" / "keepers.csv"
    b = bytearray(f.read_bytes())
    b[-3] ^= 1  # one byte
    f.write_bytes(bytes(b))
    p = cli("verify", run, check=False)
    assert p.returncode == 3 and "changed" in p.stdout and "keepers.csv" in p.stdout


@pytest.mark.slow
def test_cli_errors_are_messages_not_tracebacks(tmp_path):
    p = cli("train", "--data", tmp_path / "missing", "--out", tmp_path / "r", check=False)
    assert p.returncode == 1 and p.stderr.startswith("error:") and "Traceback" not in p.stderr
    p = cli("query", tmp_path, "--prompt", "x", check=False)
    assert p.returncode == 1 and "not a Traceprop run" in p.stderr
    p = cli("train", "--data", tmp_path, "--out", tmp_path / "r2", "--sketch", "nope", check=False)
    assert p.returncode == 2 and "invalid choice" in p.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        ["train"],
        ["index"],
        ["query"],
        ["bench", "overhead"],
        ["bench", "query"],
        ["audit"],
        ["verify"],
        ["info"],
        ["runs"],
        ["sample"],
        ["compact"],
        ["rank"],
        ["eval", "lds"],
        ["eval", "detect"],
    ],
)
def test_every_command_documents_itself(cmd, capsys, monkeypatch):
    """``traceprop CMD --help`` exits 0 and shows the command's usage, what it does (its
    description, else its summary) and every option and argument its parser accepts."""
    import argparse

    from traceprop_engine.cli.main import main

    parsers = {}  # prog -> (parser, one-line summary), recorded as the CLI builds them
    add_parser = argparse._SubParsersAction.add_parser

    def recording(self, name, **kw):
        p = add_parser(self, name, **kw)
        parsers[p.prog] = (p, kw.get("help"))
        return p

    monkeypatch.setattr(argparse._SubParsersAction, "add_parser", recording)
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    prog = " ".join(["traceprop", *cmd])
    parser, summary = parsers[prog]
    assert out.startswith(f"usage: {prog}")
    assert summary, f"{prog} has no summary line in its group's --help"
    about = "".join((parser.description or summary).split())  # help wraps lines: no spaces
    assert about[:80] in "".join(out.split()), f"{prog} --help does not say what it does"
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            missing = [name for name in action.choices if name not in out]
        elif action.option_strings:
            missing = [] if any(o in out for o in action.option_strings) else action.option_strings
        else:
            missing = [] if (action.metavar or action.dest) in out else [action.dest]
        assert not missing, f"{prog} --help does not list {missing}"
