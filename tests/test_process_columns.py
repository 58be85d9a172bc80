"""The process lists and process samples folded as columns give what folding them entry by entry gives."""

from __future__ import annotations

import random

import pytest

from atopgpud_tw.readers.nvml.device import _merge_lists
from atopgpud_tw.readers.nvml.samples import (
    ProcessSamples,
    UtilSample,
    fold_process_samples,
    fresh_process_samples,
    latest_process_figures,
    lists_busy_periods,
    samples_per_pid,
)
from atopgpud_tw.snapshot import UNSUPPORTED, merge_kind, merge_memory


def merged_entry_by_entry(lists: list[tuple[str, tuple[list[int], list[int | None]]]]) -> dict:
    found: dict[int, tuple[str, int | None]] = {}
    for kind, (pids, used) in lists:
        for pid, memory in zip(pids, used):
            memory_kib = UNSUPPORTED if memory is None else memory // 1024
            seen = found.get(pid)
            if seen is None:
                found[pid] = (kind, memory_kib)
            else:
                found[pid] = (merge_kind(seen[0], kind), merge_memory(seen[1], memory_kib, "max"))
    return found


def a_list(rng: random.Random, pids: list[int]) -> tuple[list[int], list[int | None]]:
    listed = rng.sample(pids, rng.randint(0, len(pids)))
    if listed and rng.random() < 0.3:
        listed.append(rng.choice(listed))  # listed twice
    used = [None if rng.random() < 0.1 else rng.randint(0, 1 << 36) for _ in listed]
    return listed, used


@pytest.mark.parametrize("seed", range(200))
def test_merged_lists_are_the_entries_merged_one_by_one(seed):
    """Both lists, a pid in both or twice in one, memory unknown: kinds and memory as the per-entry merge,
    in the order pids are first listed."""
    rng = random.Random(seed)
    pids = rng.sample(range(100, 200), 8)
    lists = [("C", a_list(rng, pids)), ("G", a_list(rng, pids))]
    kinds, memory = _merge_lists(lists)
    assert list(kinds) == list(memory)
    assert {pid: (kinds[pid], memory[pid]) for pid in kinds} == merged_entry_by_entry(lists)
    assert list(kinds) == list(merged_entry_by_entry(lists))


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
