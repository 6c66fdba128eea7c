"""Which records score an example (``IndexSettings.records``): the weights against hand-made
records, and the settings' checks."""

from __future__ import annotations

import numpy as np
import pytest

from traceprop_engine import constants as C
from traceprop_engine.attribution.score.record_weights import record_weights
from traceprop_engine.errors import ConfigError
from traceprop_engine.settings import IndexSettings


def _records(example, epoch, lr):
    return {
        C.REC_EXAMPLE: np.asarray(example, np.int64),
        C.REC_EPOCH: np.asarray(epoch, np.int32),
        C.REC_LR: np.asarray(lr, np.float32),
    }


def test_last_epoch_keeps_each_examples_own_last_epoch():
    # examples 0 and 1 trained in epochs 0-2; example 2 twice in epoch 1 and, the run cut short
    # in epoch 2 before reaching it, not after; example 5 once
    rec = _records(
        [0, 1, 2, 0, 1, 2, 2, 0, 1, 5],
        [0, 0, 0, 1, 1, 1, 1, 2, 2, 2],
        [3, 3, 3, 2, 2, 2, 2, 1, 1, 0.5],
    )
    np.testing.assert_array_equal(record_weights(rec, "all"), rec[C.REC_LR])
    # each kept record weighs its epoch's mean rate: epoch 1 2, epoch 2 (1 + 1 + 0.5) / 3
    np.testing.assert_allclose(
        record_weights(rec, "last-epoch"), [0, 0, 0, 0, 0, 2, 2, 2.5 / 3, 2.5 / 3, 2.5 / 3]
    )
    one = _records([4, 2, 7], [0, 0, 0], [1, 2, 3])  # one epoch: every record, its mean rate
    np.testing.assert_allclose(record_weights(one, "last-epoch"), [2, 2, 2])
    zero = _records([0, 1, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0])  # lr 0: every score stays 0
    np.testing.assert_array_equal(record_weights(zero, "last-epoch"), [0, 0, 0, 0])
    empty = _records([], [], [])
    assert record_weights(empty, "last-epoch").shape == (0,)


def test_the_setting_names_its_index_and_leaves_per_record_rows_alone():
    s = IndexSettings()
    assert s.records.value == "last-epoch"  # the default
    assert s.name == "kfac-cos" and s.to_dict()["records"] == "last-epoch"
    every = IndexSettings(records="all")  # what every index built before the choice holds
    assert every.name == "kfac-cos-all" and "records" not in every.to_dict()
    # a per-record index has one row per record: nothing to choose among
    rec = IndexSettings(per_record=True, records="last-epoch")
    assert rec.records.value == "all" and rec.name == "kfac-cos-rec"
    assert "records" not in rec.to_dict()
    with pytest.raises(ConfigError, match="records"):
        IndexSettings(records="first-epoch")
