"""The process samples folded as columns give what folding them entry by entry gives."""

from __future__ import annotations

import random

import pytest

from atopgpud_tw.readers.nvml.samples import (
    ProcessSamples,
    UtilSample,
    fold_process_samples,
    fresh_process_samples,
    latest_process_figures,
    lists_busy_periods,
    samples_per_pid,
)


def some_samples(rng: random.Random) -> list[UtilSample]:
    rows = []
    for _ in range(rng.randint(0, 12)):
        pid = rng.choice((7, 8, 9, 10))
        stamp = rng.choice((90, 100, 110, 120, 130))
        sm = rng.choice((0, 30, 60, 100, 101, 250)) if rng.random() < 0.2 else rng.randint(0, 100)
        rows.append(UtilSample(pid, stamp, sm, rng.randint(0, 100)))
    if rows and rng.random() < 0.5:
        rows = [UtilSample(row.pid + n, row.timeStamp, row.smUtil, row.memUtil) for n, row in enumerate(rows)]
    return rows


@pytest.mark.quick_cases(30)
@pytest.mark.parametrize("seed", range(300))
def test_columns_fold_as_their_entries(seed):
    """Stale entries, figures above 100 %, a pid twice at one stamp or at two: every fold reads the
    columns as it reads the same entries (asked twice, with two `since`, as a poll does)."""
    rng = random.Random(seed)
    rows = some_samples(rng)
    columns = ProcessSamples(*(list(column) for column in zip(*rows))) if rows else ProcessSamples([], [], [], [])
    assert list(columns) == rows and len(columns) == len(rows)
    for since in (0, 100, 0, 95):
        for fold in (fresh_process_samples, latest_process_figures, lists_busy_periods, samples_per_pid):
            assert fold(columns, since) == fold(rows, since), (fold, since)
        assert fold_process_samples(columns, since, periods=3) == fold_process_samples(rows, since, periods=3)
        assert fold_process_samples(columns, since, None, 10, 40) == fold_process_samples(rows, since, None, 10, 40)
