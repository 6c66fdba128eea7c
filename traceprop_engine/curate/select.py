"""Which training examples to remove, and why: the top-k proponents or opponents of one or more
queries, the top of a query-independent ranking (self-influence, loss, gradient norm), and rows
picked by hand (example ids or ``source:row``).

A :class:`Selection` says what to pick; :func:`select_examples` asks the run and returns one
:class:`Removal` per example, each with every reason that picked it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from .. import constants as C
from ..errors import ConfigError, QueryError

MAX_TOP_K = 10_000


@dataclass(frozen=True)
class CurateQuery:
    """One query that motivates the change: text (``prompt``/``completion``, or ``prompt`` and
    ``label`` on a classification run), or an eval example of the run by id."""

    prompt: str = ""
    completion: str = ""
    label: str | None = None
    eval_example: int | None = None

    def __post_init__(self) -> None:
        if self.eval_example is None and not (self.prompt or "").strip():
            raise QueryError(
                "a curate query needs a prompt (with --completion or --label), or --eval-example"
            )
        if self.eval_example is None and self.label is None and not (self.completion or ""):
            raise QueryError(
                "a curate query needs a completion: the output whose origin you want removed "
                f"(prompt {self.prompt[:60]!r})"
            )

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "completion": self.completion,
            "label": self.label,
            "eval_example": self.eval_example,
        }


@dataclass(frozen=True)
class Selection:
    """What to remove.

    Args:
        queries: the queries whose top ``top_k`` proponents (or opponents) are removed.
        top_k: how many per query, or from the ranking ``by``.
        opponents: remove each query's top opponents instead of its proponents.
        by: a query-independent ranking (``self-influence``, ``loss``, ``gradient-norm``)
            whose top ``top_k`` are removed.
        ids: rows picked by hand: example ids (``"12"``) or ``"source:row"`` (``"a.jsonl:7"``).
        preconditioner: the ranking the queries and self-influence are ranked with.
    """

    queries: tuple[CurateQuery, ...] = ()
    top_k: int = 0
    opponents: bool = False
    by: str | None = None
    ids: tuple[str, ...] = ()
    preconditioner: str = C.DEFAULT_PRECONDITIONER

    def __post_init__(self) -> None:
        object.__setattr__(self, "queries", tuple(self.queries))
        ids = dict.fromkeys(str(i).strip() for i in self.ids if str(i).strip())  # once each
        object.__setattr__(self, "ids", tuple(ids))
        if not (self.queries or self.by or self.ids):
            raise ConfigError(
                "nothing selected: give a query (--prompt/--completion or --eval-example) with "
                "--remove-top-k, a ranking (--by self-influence|loss --remove-top-k), or --remove-ids"
            )
        if (self.queries or self.by) and not 1 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(
                f"--remove-top-k must be 1..{MAX_TOP_K} with a query or --by, got {self.top_k}"
            )
        if self.by is not None:
            from ..attribution import RankBy
            from ..settings import parse_choice

            object.__setattr__(self, "by", parse_choice(RankBy, self.by, "--by").value)

    def to_dict(self) -> dict:
        return {
            "queries": [q.to_dict() for q in self.queries],
            "top_k": self.top_k,
            "opponents": self.opponents,
            "by": self.by,
            "ids": list(self.ids),
            "preconditioner": self.preconditioner,
        }


@dataclass
class Removal:
    """One training example to remove and every reason that picked it."""

    example_id: int
    source: str
    row: int
    sha256: str
    text: str
    reasons: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        why = "; ".join(r["why"] for r in self.reasons)
        return {
            "example_id": self.example_id,
            "source": self.source,
            "row": self.row,
            "sha256": self.sha256,
            "text": self.text,
            "why": why,
            "reasons": self.reasons,
        }


def query_text(run, q: CurateQuery) -> dict:
    """The query as text (``prompt``, ``completion``, ``label``), so the retrained run, whose
    example ids differ, can be asked the same question.

    Raises:
        QueryError: no such eval example.
    """
    if q.eval_example is None:
        return {"prompt": q.prompt, "completion": q.completion, "label": q.label}
    ev = run.eval_examples().filter(pl.col("example_id") == int(q.eval_example))
    if ev.is_empty():
        raise QueryError(f"{q.eval_example} is not an eval example of this run")
    r = ev.row(0, named=True)
    if r["label"]:
        return {"prompt": r["text"], "completion": "", "label": r["label"]}
    if r["completion"]:
        return {"prompt": r["prompt"] or "", "completion": r["completion"], "label": None}
    return {"prompt": r["text"], "completion": "", "label": None}


def _short(text: str, n: int = 80) -> str:
    one = " ".join((text or "").split())
    return one if len(one) <= n else one[: n - 1] + "…"


def _by_query(run, sel: Selection, settings, out: dict, train: pl.DataFrame) -> list[dict]:
    asked = []
    kind = "opponent" if sel.opponents else "proponent"
    for i, q in enumerate(sel.queries):
        qt = query_text(run, q)
        res = run.query(
            qt["prompt"],
            qt["completion"] or None,
            label=qt["label"],
            top_k=sel.top_k,
            opponents=sel.opponents,
            settings=settings,
        )
        part = res.rows.filter(pl.col("kind") == kind).sort("rank").head(sel.top_k)
        what = f"{qt['prompt']!r} → {qt['label'] or qt['completion']!r}"
        for r in part.iter_rows(named=True):
            why = f"{kind} #{r['rank']} (score {r['score']:+.4g}) of query {i + 1}: {_short(what)}"
            reason = {"by": "query", "query": i, "kind": kind, "rank": int(r["rank"])}
            _add(
                out, train, int(r["example_id"]), {**reason, "score": float(r["score"]), "why": why}
            )
        asked.append({**qt, "query_loss": float(res.query.get("query_loss", float("nan")))})
        asked[-1]["found"] = part.height
    return asked


def _by_ranking(run, sel: Selection, settings, out: dict, train: pl.DataFrame) -> None:
    from ..attribution import RankBy, rank_examples

    by = RankBy(sel.by)
    ranked = rank_examples(run, by, settings)
    ranked = ranked.join(train.select("example_id"), on="example_id", how="semi").head(sel.top_k)
    for r in ranked.iter_rows(named=True):
        v = r[by.column]
        why = f"{by.value} #{r['rank']} ({v:.4g})"
        reason = {"by": by.value, "rank": int(r["rank"]), "value": float(v), "why": why}
        _add(out, train, int(r["example_id"]), reason)


def _by_hand(sel: Selection, out: dict, train: pl.DataFrame, examples: pl.DataFrame) -> None:
    for token in sel.ids:
        if token.isdigit():
            hit = examples.filter(pl.col("example_id") == int(token))
        else:
            source, _, row = token.rpartition(":")
            if not source or not row.isdigit():
                raise ConfigError(
                    f"--remove-ids {token!r}: give an example id (12) or source:row (a.jsonl:7)"
                )
            hit = examples.filter((pl.col("source") == source) & (pl.col("row") == int(row)))
        if hit.is_empty():
            raise ConfigError(f"--remove-ids {token!r}: no such example in this run")
        eid = int(hit["example_id"][0])
        if hit["split"][0] != C.SPLIT_TRAIN:
            raise ConfigError(
                f"--remove-ids {token!r} is an eval example, not training data: only training "
                "examples can be removed"
            )
        _add(out, train, eid, {"by": "hand", "token": token, "why": f"picked by hand ({token})"})


def _add(out: dict, train: pl.DataFrame, eid: int, reason: dict) -> None:
    if eid not in out:
        r = train.filter(pl.col("example_id") == eid)
        if r.is_empty():
            return  # not a training example (the rankings hold only training rows)
        r = r.row(0, named=True)
        text = r["text"] or ((r["prompt"] or "") + (r["completion"] or ""))
        out[eid] = Removal(eid, r["source"], int(r["row"]), r["sha256"], _short(text, 200))
    if reason not in out[eid].reasons:  # the same row picked twice the same way: one reason
        out[eid].reasons.append(reason)


def select_examples(run, sel: Selection) -> tuple[list[Removal], list[dict]]:
    """The training examples ``sel`` picks on ``run`` (an ``AttributionRun``).

    Returns:
        ``(removals, queries)``: the removals in example order, and each query as text with
        its loss on the run's model and how many examples it contributed.

    Raises:
        ConfigError: a hand-picked row that is no training example of the run.
        QueryError: a query the run cannot answer.
    """
    from ..settings import IndexSettings

    settings = run.settings(IndexSettings(preconditioner=sel.preconditioner))
    examples = run.examples()
    train = examples.filter(pl.col("split") == C.SPLIT_TRAIN)
    out: dict[int, Removal] = {}
    asked = _by_query(run, sel, settings, out, train) if sel.queries else []
    if sel.by:
        _by_ranking(run, sel, settings, out, train)
    _by_hand(sel, out, train, examples)
    return [out[k] for k in sorted(out)], asked
