"""``ScrapedCounters``: a Prometheus collector that reads an engine's counters when ``/metrics`` is scraped.

The engines count on their model thread into plain dicts (no locks, no client-library calls in the step); a
collector turns one snapshot of them into metric families at scrape time. A subclass writes only ``families``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric


class ScrapedCounters:
    def __init__(self, counters: Callable[[], dict], labels: dict[str, str]):
        self._counters, self._labels = counters, dict(labels)

    def describe(self) -> list:
        return []  # nothing to check at registration: the families exist only at scrape time

    def collect(self) -> Iterator[Metric]:
        yield from self.families(self._counters(), list(self._labels), list(self._labels.values()))

    def families(self, values: dict, names: list[str], label_values: list[str]) -> Iterator[Metric]:
        raise NotImplementedError
