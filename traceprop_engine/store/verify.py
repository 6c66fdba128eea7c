"""A store's content digests recomputed and compared with those written at completion
(``traceprop verify``, :meth:`.reader.Store.verify_content`)."""

from __future__ import annotations

from .. import constants as C
from .format import (
    DIGEST_ATTR,
    DIGEST_COVERAGE,
    FULL_DIGEST_ATTR,
    content_digest,
    full_content_digest,
    records_full_digest,
)


def verify_content(store) -> dict:
    """Recompute the content digests and compare them with those written at completion.

    Returns:
        ``{"status": ok|changed|unreadable|absent|unchecked|unrecorded, "expected", "actual",
        "detail", "digest_version", "covers"}``: ``absent`` when a store written with a
        digest has lost it, ``unchecked`` for a store written before digests were recorded
        (nothing to compare), ``unrecorded`` for one whose writer never closed it (killed:
        it never had one). ``digest_version`` says what the compared digest covers (``covers``, in
        words, from :data:`~.format.DIGEST_COVERAGE`): 2 for ``content_sha256_v2``, 1 for a
        store written before it (its projections and example table are not covered, and
        ``detail`` says so).
    """
    at = store._f.attrs
    want1, want2 = (str(at[a]) if a in at else None for a in (DIGEST_ATTR, FULL_DIGEST_ATTR))
    full = want2 is not None or records_full_digest(store._f)
    version = 2 if full else 1
    out = {"digest_version": version, "covers": DIGEST_COVERAGE[version]}
    if store.status == C.STATUS_RUNNING and want1 is None and want2 is None:
        return {**out, "status": "unrecorded", "expected": None, "actual": None,
                "detail": "its writer never closed it (a train still running, or killed "
                "outright); a store records its content digest when it closes"}  # fmt: skip
    try:
        got1 = content_digest(store._f)
        got2 = full_content_digest(store._f, got1) if full else None
    except (OSError, KeyError, ValueError) as e:
        return {**out, "status": "unreadable", "expected": want2 or want1, "actual": None,
                "detail": str(e)}  # fmt: skip
    want, got = (want2, got2) if full else (want1, got1)
    lost = [a for a, w in ((DIGEST_ATTR, want1), (FULL_DIGEST_ATTR, want2)) if w is None]
    if want is None or (full and lost):
        first = (
            store._f[f"{store.layers[0].group}/{C.L_U if store.layers[0].rank else C.L_SKETCH}"]
            if store.layers
            else None
        )
        legacy = not full and (first is None or not first.fletcher32)
        return {
            **out,
            "status": "unchecked" if legacy else "absent",
            "expected": None,
            "actual": got,
            "detail": "written before stores recorded a content digest"
            if legacy
            else f"the content digest attribute {' and '.join(lost)} was removed",
        }
    return {
        **out,
        "status": "ok" if got == want and got1 == want1 else "changed",
        "expected": want,
        "actual": got,
        "detail": "" if full else f"its digest covers {DIGEST_COVERAGE[1]}",
    }
