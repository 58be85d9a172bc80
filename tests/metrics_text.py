"""A metrics page read back: its samples by name and labels; and the poller's figures a page reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples_of(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a page by (sample name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def series(page: dict, name: str, **labels: str) -> list[float]:
    wanted = set(labels.items())
    return [value for (got, keys), value in page.items() if got == name and wanted <= keys]


class FakePoller:
    """What the metrics page and the readiness endpoint read from the poller."""

    def __init__(self, polls: int = 0, failed_polls: dict[str, int] | None = None, failing: str | None = None,
                 waiting: str | None = None) -> None:
        self.polls = polls
        self.failed_polls = failed_polls or {}
        #: the cause the reader fails with now, and what it waits for (None: nothing)
        self.failing = failing
        self.waiting = waiting
