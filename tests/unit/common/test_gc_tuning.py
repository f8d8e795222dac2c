"""A serving process's collector settings: start-up frozen, collections rarer."""

import gc

from services.common.gc_tuning import THRESHOLDS, tune_gc


def test_tune_gc_freezes_start_up_and_raises_the_thresholds():
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == THRESHOLDS
        assert THRESHOLDS[0] > before[0]  # fewer young collections than CPython's default
        assert gc.get_freeze_count() > 0  # what start-up made is out of every collection
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
