"""The driver's sample period from the gaps between its samples (`samples.period_from_gaps`):
found by bisection, the same as the rule it is written down as, the shortest gap that recurs."""

from __future__ import annotations

import random

from atopgpud_tw.readers.nvml.samples import period_from_gaps


def by_the_rule(gaps: list[int]) -> int:
    """The rule spelt out: the first gap, in order, with a tenth of the gaps (or two) within 20 % above it."""
    ordered = sorted(gaps)
    need = max(2, len(ordered) // 10)
    found = ordered[len(ordered) // 2]
    for index, gap in enumerate(ordered):
        cluster = [g for g in ordered[index:] if g <= gap * 1.2]
        if len(cluster) >= need:
            found = cluster[len(cluster) // 2]
            break
    return found


def test_the_period_is_the_rule_s_for_any_gaps() -> None:
    chance = random.Random(27)
    for _ in range(3000):
        period = chance.choice([1, 5, 166_666, 1_000_000])
        gaps = [max(0, round(period * chance.choice([1, 1, 1.1, 1.19, 1.2, 1.21, 2, 3.5, 0.5])))
                for _ in range(chance.randint(1, 64))]
        assert period_from_gaps(gaps) == by_the_rule(gaps), gaps
