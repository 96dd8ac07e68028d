"""Page-count buckets: the one rule that decides the row count of every staging array.

Every jitted kernel is compiled once per distinct input shape. If the staging array had exactly as many rows as a
request has pages, each new prompt length would compile a new gather, scatter and host copy. Instead the row count is
rounded up to a bucket: powers of two up to ``POW2_LIMIT``, then multiples of ``STEP``. That gives about
``log2(POW2_LIMIT) + max_pages / STEP`` shapes in all, and wastes at most half the rows for small requests and less
than ``STEP`` rows for long ones.

Prefill and decode must agree on the bucket (the staging shape travels over the wire), so both call
:func:`page_bucket`; do not round page counts anywhere else.
"""

from __future__ import annotations

POW2_LIMIT = 256
STEP = 256


def page_bucket(num_pages: int) -> int:
    """The staging row count for ``num_pages`` real pages: the smallest bucket that holds them."""
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"page count must be a positive int, got {num_pages!r}")
    if num_pages <= POW2_LIMIT:
        return 1 << (num_pages - 1).bit_length()
    return -(-num_pages // STEP) * STEP


def bucket_sizes(max_pages: int) -> list[int]:
    """Every bucket up to the one holding ``max_pages``: the shapes a warm-up should compile."""
    sizes = []
    size = 1
    while size < page_bucket(max_pages):
        sizes.append(size)
        size = size * 2 if size < POW2_LIMIT else size + STEP
    sizes.append(page_bucket(max_pages))
    return sizes
