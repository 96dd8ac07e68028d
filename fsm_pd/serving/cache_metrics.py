"""``/metrics`` of an engine's prefill work and prefix cache, read at scrape time.

``fsm_pd_prefill_tokens_total{kind="computed"|"cached"}``: prompt tokens a node prefilled, and prompt tokens whose KV
it took from its prefix cache instead (tokens not computed); the hit ratio is ``cached / (computed + cached)``. With a
cache: ``fsm_pd_prefix_cache_pages`` (held, and locked by running requests) and
``fsm_pd_prefix_cache_evicted_pages_total``. The Grafana dashboard (``docs/grafana-dashboard.json``) plots them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fsm_pd.serving.scraped import ScrapedCounters


class PrefillCollector(ScrapedCounters):
    def families(self, values: dict, names: list[str], label_values: list[str]) -> Iterator[Metric]:
        tokens = CounterMetricFamily("fsm_pd_prefill_tokens", "Prompt tokens prefilled (computed) and taken from "
                                     "the prefix cache (cached)", labels=[*names, "kind"])
        tokens.add_metric([*label_values, "computed"], values["prefill_computed_tokens"])
        tokens.add_metric([*label_values, "cached"], values["prefill_cached_tokens"])
        yield tokens
        if "cached_pages" not in values:
            return
        pages = GaugeMetricFamily("fsm_pd_prefix_cache_pages", "KV pages the prefix cache holds, and of those the "
                                  "ones running requests use (locked)", labels=[*names, "state"])
        pages.add_metric([*label_values, "held"], values["cached_pages"])
        pages.add_metric([*label_values, "locked"], values["cached_pages_locked"])
        yield pages
        evicted = CounterMetricFamily("fsm_pd_prefix_cache_evicted_pages", "Pages the prefix cache gave back to "
                                      "requests that needed them", labels=names)
        evicted.add_metric(label_values, values["prefix_evicted_pages"])
        yield evicted
