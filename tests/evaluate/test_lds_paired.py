"""benchmarks/lds_paired.py: the default against a reference row, paired per eval example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lds_paired.py"


def _folder(tmp: Path, name: str, rows: dict[str, np.ndarray]) -> str:
    d = tmp / name
    d.mkdir()
    table = [
        {"method": m, "per_example": v.tolist(), "lds": float(v.mean())} for m, v in rows.items()
    ]
    (d / "results.json").write_text(json.dumps({"rows": table}))
    return f"{name}={d}"


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_paired_differences_verdicts_and_the_offset(tmp_path):
    rng = np.random.default_rng(0)
    ref = rng.uniform(0.2, 0.8, 60)
    noise = rng.normal(0.0, 0.2, 60)
    above = _folder(tmp_path, "up", {"default": ref + 0.05, "full-gradient cosine": ref})
    below = _folder(tmp_path, "down", {"default": ref - 0.05, "full-gradient cosine": ref})
    tie = _folder(tmp_path, "tie", {"default": ref + noise, "full-gradient cosine": ref})
    lines = {
        ln.split("|")[1].strip(): ln for ln in _run(above, below, tie).splitlines() if "|" in ln
    }
    assert "+0.050 [+0.050, +0.050] | above" in lines["up"]
    assert "-0.050 [-0.050, -0.050] | below" in lines["down"]
    assert "| tie |" in lines["tie"]
    # the same rows with the reference lifted by 0.05: the first pair now ties at 0
    out = _run("--plus", "0.05", above)
    assert "+0.000 [+0.000, +0.000] | tie" in out and "full-gradient cosine + 0.05" in out


def test_the_summary_over_pairs_and_a_missing_row(tmp_path):
    ref = np.linspace(0.1, 0.9, 40)
    a = _folder(tmp_path, "a", {"default": ref + 0.02, "bm25": ref})
    b = _folder(tmp_path, "b", {"default": ref - 0.01, "bm25": ref})
    out = _run("--ref", "bm25", a, b)
    assert "over 2 pairs: mean Δ +0.0050" in out and "≥ 0 on 1 of 2" in out
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ref", "same label", a], capture_output=True, text=True
    )
    assert done.returncode != 0 and "no row 'same label'" in done.stderr
