"""Retraction under KV pressure (SGLang's "retract"): which running sequences give their pages back, and how many.

Every running sequence grows by one page every ``page_size`` tokens. When the pages the running batch needs for
its next step are more than the pool has free, the newest sequences (by arrival) are retracted one at a time, each
giving back every page it holds, until what the others need fits. The oldest is never retracted: admission refuses
a request whose prompt plus ``max_new_tokens`` cannot fit the whole pool, so the oldest alone always fits once the
pages held elsewhere come back. A retracted sequence keeps its tokens; it resumes, oldest first, when its pages fit
again with headroom to spare, and its KV is recomputed then from the prompt plus the tokens generated so far (one
batched prefill: the decode node has the weights, so nothing is asked of the prefill node). Sampling depends on
the request's seed and step only, so the tokens after a resume are the ones an unpressured run would have drawn;
the client sees a pause in its stream, never an error.

Why the newest: it has generated the least, so its recompute is the cheapest, and a request that keeps its place
in the order cannot be retracted forever by later arrivals.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fsm_pd.serving.scraped import ScrapedCounters

Item = TypeVar("Item")


def pick_retractions(demands: Sequence[tuple[Item, int, int]], free_pages: int) -> list[Item]:
    """``demands``: ``(item, pages it holds, pages it lacks for its next step)``, oldest first. Returns the items to
    retract, newest first: the fewest newest ones whose pages, with ``free_pages``, cover what the rest lack. The
    oldest is never among them (when even it cannot grow, it waits for pages held outside the batch)."""
    lacking = sum(missing for _, _, missing in demands)
    free = free_pages
    victims: list[Item] = []
    for item, held, missing in reversed(demands[1:]):
        if lacking <= free:
            break
        victims.append(item)
        free += held
        lacking -= missing
    return victims


class DecodeLoopCollector(ScrapedCounters):
    """``/metrics``: the decode loop's retractions and resumptions, and its steps' time per phase, read at scrape
    time."""

    def families(self, values: dict, names: list[str], label_values: list[str]) -> Iterator[Metric]:
        for name, key, doc in (
            ("fsm_pd_preemptions", "preempted", "Running requests retracted (pages given back) under KV pressure"),
            ("fsm_pd_resumptions", "resumed", "Retracted requests resumed (KV recomputed from prompt and output)"),
            ("fsm_pd_recomputed_tokens", "recomputed_tokens", "Tokens whose KV was recomputed on resume"),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(label_values, float(values[key]))
            yield family
        waiting = GaugeMetricFamily("fsm_pd_requests_retracted", "Retracted requests waiting to resume",
                                    labels=names)
        waiting.add_metric(label_values, float(values["retracted_waiting"]))
        yield waiting
        steps = CounterMetricFamily("fsm_pd_decode_steps", "Batched decode steps run", labels=names)
        steps.add_metric(label_values, float(values["decode_steps"]))
        yield steps
        dispatches = CounterMetricFamily("fsm_pd_decode_dispatches", "Dispatches of decode steps sampled on the "
                                         "device (several steps each: --decode-steps-per-dispatch)", labels=names)
        dispatches.add_metric(label_values, float(values["decode_dispatches"]))
        yield dispatches
        phases = CounterMetricFamily("fsm_pd_decode_phase_seconds", "Time in decode steps by phase: forward (the "
                                     "model; with several steps a dispatch, starting it and waiting for its tokens), "
                                     "sample, logprobs, emit (stop checks, detokenizing, streaming)",
                                     labels=[*names, "phase"])
        for phase, seconds in values["decode_phase_seconds"].items():
            phases.add_metric([*label_values, phase], seconds)
        yield phases
