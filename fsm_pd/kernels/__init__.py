"""KV pool layout and the page kernels: gather pages to staging, scatter staging to pages, host staging slots."""

from fsm_pd.kernels.buckets import bucket_sizes, page_bucket
from fsm_pd.kernels.host_staging import HostPoolExhausted, HostSlot, HostStagingPool, copy_to_host, host_memory_kind
from fsm_pd.kernels.layout import PAD_PAGE, KVLayout
from fsm_pd.kernels.page_copy import (
    Impl,
    gather_pages,
    gather_pages_into,
    resolve_impl,
    scatter_layers,
    scatter_pages,
    staging_block,
)
from fsm_pd.kernels.runs import PageRuns, page_runs

__all__ = [
    "PAD_PAGE",
    "HostPoolExhausted",
    "HostSlot",
    "HostStagingPool",
    "Impl",
    "KVLayout",
    "PageRuns",
    "bucket_sizes",
    "copy_to_host",
    "gather_pages",
    "gather_pages_into",
    "host_memory_kind",
    "page_bucket",
    "page_runs",
    "resolve_impl",
    "scatter_layers",
    "scatter_pages",
    "staging_block",
]
