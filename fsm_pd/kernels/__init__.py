"""KV pool layout and the page kernels: gather pages to staging, scatter staging to pages, writes of new KV.

The names below load their module on first use (PEP 562): ``layout`` and ``page_buckets`` are plain Python, and the
jax-free resharding plan (``fsm_pd.transport.reshard``) imports the layout without loading jax with the kernels.
"""

from __future__ import annotations

from fsm_pd.runtime.lazy import lazy_exports

_HOME = {
    "Impl": "page_copy",
    "KVLayout": "layout",
    "PAD_PAGE": "layout",
    "PageRuns": "runs",
    "bucket_sizes": "page_buckets",
    "gather_pages": "page_copy",
    "gather_pages_into": "page_copy",
    "page_bucket": "page_buckets",
    "page_runs": "runs",
    "resolve_impl": "page_copy",
    "scatter_layers": "page_copy",
    "scatter_pages": "page_copy",
    "staging_block": "page_copy",
}

__all__, __getattr__ = lazy_exports(__name__, _HOME)
