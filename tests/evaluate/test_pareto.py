"""The measured-configurations table: loading, the Pareto front, matching a configuration."""

from __future__ import annotations

import json

import pytest

from traceprop_engine.errors import ConfigError
from traceprop_engine.evaluate.pareto import Measured, assess, front, load_measured
from traceprop_engine.settings import TrackSettings


def _table(tmp_path, rows):
    p = tmp_path / "pareto.json"
    p.write_text(json.dumps({"datasets": ["a", "b"], "configurations": rows}))
    return p


def _row(name, lds, ovh, b, **track):
    return {
        "name": name,
        "track": track,
        "lds": {"a": lds, "b": lds},
        "overhead_pct": ovh,
        "bytes_per_example": b,
    }


def test_front_and_dominance(tmp_path):
    p = _table(
        tmp_path,
        [
            _row("cheap", 0.3, 2.0, 1000, k_in=8, k_out=8, rank=0),
            _row("good", 0.7, 10.0, 1000, k_in=64, k_out=64, rank=1),
            _row("worse", 0.6, 12.0, 1000, k_in=32, k_out=32, rank=1),
        ],
    )
    sets, rows = load_measured(p)
    assert sets == ["a", "b"] and {r.name for r in front(rows)} == {"cheap", "good"}
    hit = assess({"k_in": 32, "k_out": 32, "rank": 1}, p)
    assert hit["measured"].name == "worse" and hit["dominated_by"] == ["good"]
    assert assess({"k_in": 8, "k_out": 8, "rank": 0}, p)["dominated_by"] == []
    assert assess({"k_in": 5, "k_out": 5, "rank": 1}, p) is None
    assert Measured("x", {}, {"a": 1.0}, 1.0, 1.0).lds_mean == 1.0


def test_bad_table_is_a_clear_error(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read the measured configurations"):
        load_measured(tmp_path / "bad.json")
    assert assess({"k_in": 8}, tmp_path / "missing.json") is None


def test_the_committed_table_has_the_default_on_the_front():
    sets, rows = load_measured()
    assert len(sets) >= 2  # never a default from one data set
    (default,) = [r for r in rows if r.default]
    d = TrackSettings()
    assert default.track["k_in"] == d.k_in and default.track["rank"] == d.rank
    assert default.track["share_k"] is d.share_k
    assert assess(d.to_dict())["measured"].name == default.name  # the Launch page's lookup
    assert default.track["projection"] == d.projection.value
    old = d.to_dict()
    del old["share_k"], old["projection"]  # a run recorded before both: its own row
    got = assess(old)["measured"].track
    assert got["share_k"] is False and got["projection"] == "gaussian"
    assert default.name in {r.name for r in front(rows)}
    # no more than the former default's bytes (4380 measured; 1 byte of chunk rounding)
    assert default.bytes_per_example <= 4380 * 1.001


def test_describe_names_the_measured_quality_of_a_run_configuration(tmp_path):
    from traceprop_engine.cli.main import main
    from traceprop_engine.evaluate.pareto import describe
    from traceprop_engine.samples.run import default_root

    assert "measured on the benchmark's model (benchmarks/EVAL.md): LDS" in describe(
        TrackSettings().to_dict()
    )
    assert "not measured" in describe({"k_in": 5, "k_out": 7, "rank": 1})
    assert "none recorded" in describe(None)
    p = _table(
        tmp_path, [_row("cheap", 0.3, 2.0, 1000, k_in=8), _row("good", 0.7, 1.0, 900, k_in=9)]
    )
    assert "dominated by good" in describe({"k_in": 8}, p)
    assert main(["info", str(default_root() / "facts")]) == 0


def test_info_does_not_show_benchmark_figures_as_a_run_of_another_model(capsys):
    """The sample run (9 layers, 2304-byte records) has the default configuration, measured on
    the benchmark's model at 4381 bytes/example: info says those figures are not its own."""
    from traceprop_engine.cli.main import main
    from traceprop_engine.evaluate.pareto import describe
    from traceprop_engine.samples.run import default_root

    assert main(["info", str(default_root() / "facts")]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tracking:")][0]
    assert "not on this run's: its records are 2304 bytes each" in line
    assert "do not describe it" in line and "dominated by" not in line
    near = describe(TrackSettings().to_dict(), run_bytes=4338)  # the benchmark's own records
    assert "measured on the benchmark's model" in near and "not on this run's" not in near
