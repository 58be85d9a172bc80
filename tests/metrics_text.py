"""A metrics page read back: its samples by name and labels."""

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
