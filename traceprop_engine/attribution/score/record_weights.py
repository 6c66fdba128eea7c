"""How much each stored record counts in its example's score (``IndexSettings.records``).

An example's vector and exact score are the weighted sum of its records, one per time it was
trained on (per epoch), each the sketch of that step's gradient:

- ``all``: every record, weighted by its step's learning rate (TracIn over the whole
  trajectory; the only choice before stop 42).
- ``last-epoch`` (the default): only the records of the last epoch each example was trained in, each weighted
  by that epoch's mean learning rate. A run cut short mid-epoch keeps, for the examples the last
  epoch did not reach, their records of the epoch before. The mean, not the step's own rate: a
  schedule that decays within the epoch would otherwise weight an example by where the shuffle
  put it (the last batch of a linear decay to 0 would score 0). A run of one epoch at a constant
  rate is the same as ``all``; a run at learning rate 0 still scores 0.
"""

from __future__ import annotations

import numpy as np

from ... import constants as C
from ...index_settings import RecordChoice


def record_weights(rec: dict[str, np.ndarray], records: RecordChoice | str) -> np.ndarray:
    """``(n_records,)`` float64 weights of the store's records ``rec`` (``Store.records()``)."""
    lr = rec[C.REC_LR].astype(np.float64)
    if RecordChoice(records) is RecordChoice.ALL or not len(lr):
        return lr
    ex = rec[C.REC_EXAMPLE].astype(np.int64)
    epoch = rec[C.REC_EPOCH].astype(np.int64)
    last = np.full(int(ex.max()) + 1, np.iinfo(np.int64).min)
    np.maximum.at(last, ex, epoch)  # each example's last epoch
    first = int(epoch.min())
    per_epoch = np.bincount(epoch - first, weights=lr) / np.maximum(np.bincount(epoch - first), 1)
    return np.where(epoch == last[ex], per_epoch[epoch - first], 0.0)
