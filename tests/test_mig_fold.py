"""`--mig card`'s fold (snapshot.fold_instances): the same device as its rules stated on their own
(`total_of` of each memory figure, `merge_processes`'s "sum", a card's list unread where an instance's is)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from atopgpud_tw.snapshot import (
    UNSUPPORTED,
    DeviceSample,
    ProcessSample,
    fold_instances,
    merge_processes,
    total_of,
)

memory = st.one_of(st.none(), st.just(UNSUPPORTED), st.integers(0, 1 << 40))
process = st.builds(
    ProcessSample, st.integers(1, 6), st.sampled_from(["C", "G", "C+G"]), memory,
    st.just(UNSUPPORTED), st.just(UNSUPPORTED), st.one_of(st.none(), st.integers(0, 99)),
)
instance = st.builds(
    lambda index, total, used, processes, present: DeviceSample(
        f"GPU-a/{index}.0", f"00000000:17:00.0/{index}.0", "1g.10gb", 3,
        memory_total_kib=total, memory_used_kib=used, processes=processes, present=present,
    ),
    st.integers(1, 14), st.one_of(st.none(), st.integers(0, 1 << 30)), st.one_of(st.none(), st.integers(0, 1 << 30)),
    st.one_of(st.none(), st.lists(process, max_size=5).map(tuple)), st.booleans(),
)


def by_the_rules(instances: list[DeviceSample]) -> DeviceSample:
    parts = [part for part in instances if part.present]
    processes = None
    if all(part.processes is not None for part in parts):
        processes = merge_processes((p for part in parts for p in part.processes or ()), memory="sum")
    return DeviceSample(
        "GPU-a", "00000000:17:00.0", "NVIDIA A100-SXM4-80GB", 3,
        memory_total_kib=total_of([part.memory_total_kib for part in parts]),
        memory_used_kib=total_of([part.memory_used_kib for part in parts]),
        processes=processes,
    )


@given(st.lists(instance, max_size=8))
def test_the_fold_is_its_rules(instances):
    folded = fold_instances("GPU-a", "00000000:17:00.0", "NVIDIA A100-SXM4-80GB", iter(instances), 3)
    assert folded == by_the_rules(instances)


def test_a_pid_on_two_instances_and_an_instance_that_failed():
    """A pid on two instances: its kinds merged, its memory added (unknown if either is); an
    instance whose list failed fails the card's list, one not present counts for nothing."""
    first = DeviceSample("a/1", "b/1", "1g", 3, memory_total_kib=10, memory_used_kib=4,
                         processes=(ProcessSample(7, "C", 100), ProcessSample(8, "C", UNSUPPORTED)))
    second = DeviceSample("a/2", "b/2", "1g", 3, memory_total_kib=20, memory_used_kib=None,
                          processes=(ProcessSample(7, "G", 50), ProcessSample(8, "C", 5)))
    gone = DeviceSample("a/3", "b/3", "1g", 3, memory_total_kib=None, processes=None, present=False)
    card = fold_instances("a", "b", "A100", [first, second, gone])
    assert (card.memory_total_kib, card.memory_used_kib) == (30, None)
    assert card.processes == (ProcessSample(7, "C+G", 150), ProcessSample(8, "C", UNSUPPORTED))
    assert (card.gpu_busy, card.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
    failed = DeviceSample("a/4", "b/4", "1g", 3, processes=None)
    assert fold_instances("a", "b", "A100", [first, failed]).processes is None
