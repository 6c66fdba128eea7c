"""Quality per byte per FLOP of tracking configurations: the measured table and its Pareto front.

The table (``benchmarks/results/pareto.json``, written by hand from measured runs: each entry
names the commands that produced its numbers) holds per configuration the LDS on each data set,
the training-step overhead and the bytes per example. The app's Launch page shows it and warns
when a chosen configuration is dominated; ``benchmarks/pareto.py`` renders it for EVAL.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..errors import ConfigError
from ..settings import RECORDED_BEFORE_KEYS

PARETO_FILE = C.REPO_ROOT / "benchmarks" / "results" / "pareto.json"
MATCH_KEYS = (
    "k_in",
    "k_out",
    "share_k",
    "projection",
    "rank",
    "factor_space",
    "factor_dtype",
    "power_iters",
)
BYTES_TOLERANCE = 0.01
RUN_BYTES_TOLERANCE = 0.05
"""A run's records within 5 % of a measured configuration's bytes per example (which also
count the per-record metadata) are taken to be that configuration on the benchmark's model."""


@dataclass(frozen=True)
class Measured:
    """One measured configuration."""

    name: str
    track: dict
    lds: dict
    overhead_pct: float
    bytes_per_example: float
    default: bool = False

    @property
    def lds_mean(self) -> float:
        return sum(self.lds.values()) / len(self.lds)

    def dominated_by(self, other: Measured) -> bool:
        """``other`` is at least as good on LDS, overhead and bytes, and better on one (bytes
        within :data:`BYTES_TOLERANCE` count as equal: record metadata rounds differently)."""
        tol = BYTES_TOLERANCE * self.bytes_per_example
        ge = (
            other.lds_mean >= self.lds_mean
            and other.overhead_pct <= self.overhead_pct
            and other.bytes_per_example <= self.bytes_per_example + tol
        )
        gt = (
            other.lds_mean > self.lds_mean
            or other.overhead_pct < self.overhead_pct
            or other.bytes_per_example < self.bytes_per_example - tol
        )
        return ge and gt


def load_measured(path: str | Path = PARETO_FILE) -> tuple[list[str], list[Measured]]:
    """``(data set names, configurations)`` of a measured table.

    Raises:
        ConfigError: the file is missing or not a table of this shape.
    """
    p = Path(path)
    try:
        spec = json.loads(p.read_text())
        sets = list(spec["datasets"])
        rows = [
            Measured(
                name=str(r["name"]),
                track=dict(r["track"]),
                lds={d: float(r["lds"][d]) for d in sets},
                overhead_pct=float(r["overhead_pct"]),
                bytes_per_example=float(r["bytes_per_example"]),
                default=bool(r.get("default", False)),
            )
            for r in spec["configurations"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the measured configurations {p}: {e}") from e
    return sets, rows


def front(rows: list[Measured]) -> list[Measured]:
    """The configurations no other one dominates."""
    return [r for r in rows if not any(r.dominated_by(o) for o in rows if o is not r)]


def describe(
    track: dict | None, path: str | Path = PARETO_FILE, *, run_bytes: int | None = None
) -> str:
    """One line for ``traceprop info`` and the app: the tracking configuration and, when it
    was measured, its LDS per data set, overhead and bytes (and what dominates it).

    The figures were measured on the benchmark's model (``PARETO_FILE``'s ``about``). Given
    ``run_bytes`` (a run's own bytes per record, ``stored_bytes_per_record``), a run whose
    records differ from the measured ones in size (another model: other layers) is told that
    the figures are not its own, instead of being shown them as if they were.
    """
    if not track:
        return "tracking: none recorded in run.json"
    cfg = ", ".join(f"{k}={track[k]}" for k in MATCH_KEYS if k in track and k != "power_iters")
    hit = assess(track, path)
    if hit is None:
        return (
            f"tracking: {cfg} (quality of this configuration not measured; see benchmarks/EVAL.md)"
        )
    m = hit["measured"]
    lds = ", ".join(f"{d} {v:.2f}" for d, v in m.lds.items())
    figures = (
        f"LDS {lds}; overhead {m.overhead_pct:+.1f} %; {m.bytes_per_example:.0f} bytes/example"
    )
    if run_bytes is not None and abs(run_bytes - m.bytes_per_example) > (
        RUN_BYTES_TOLERANCE * m.bytes_per_example
    ):
        return (
            f"tracking: {cfg}; this configuration was measured on the benchmark's model "
            f"(benchmarks/EVAL.md: {figures}), not on this run's: its records are {run_bytes} "
            "bytes each, so those figures do not describe it"
        )
    text = f"tracking: {cfg}; measured on the benchmark's model (benchmarks/EVAL.md): {figures}"
    if hit["dominated_by"]:
        text += f"; dominated by {', '.join(hit['dominated_by'])}"
    return text


def assess(track: dict, path: str | Path = PARETO_FILE) -> dict | None:
    """The measured figures of the configuration ``track`` describes, and what dominates it.

    Args:
        track: tracking settings (``TrackSettings.to_dict()`` or the Launch form's values).

    Returns:
        None when that configuration was not measured, else ``{"measured": Measured,
        "dominated_by": [names]}``.
    """
    try:
        _, rows = load_measured(path)
    except ConfigError:
        return None
    track = {**RECORDED_BEFORE_KEYS, **track}  # keys a run.json may predate
    want = {k: str(track.get(k)) for k in MATCH_KEYS if k in track}
    for r in rows:
        if all(str(r.track.get(k)) == v for k, v in want.items() if k in r.track):
            return {"measured": r, "dominated_by": [o.name for o in rows if r.dominated_by(o)]}
    return None
