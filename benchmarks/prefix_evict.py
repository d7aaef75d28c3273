"""Host time of the prefix cache's eviction in a full pool (CPU only): the cache holds ``--pages`` one-page
prompts, the oldest ``--held`` (each count of the list) still referenced by running requests, and each admission
that finds the pool short evicts one page (``PrefixCache.evict(1)``), as ``Scheduler.admit`` does request after
request.

    python benchmarks/prefix_evict.py --out benchmarks/results/prefix_evict_bounded_cpu.json
"""
from __future__ import annotations

import argparse
import time

from common import parse_ints, write_result

from attnzoo.attention.kv_cache import PageAllocator
from attnzoo.engine.prefix_cache import PrefixCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=60000)
    ap.add_argument("--held", type=parse_ints, default=[0, 2000])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = []
    for held in args.held:
        allocator = PageAllocator(args.pages + 1)
        cache = PrefixCache(allocator, 16)
        pages = allocator.alloc(args.pages)
        for i, page in enumerate(pages):
            cache.insert([i] * 17, [page])
        allocator.free(pages[held:])  # those requests finished: only the cache holds their pages
        start = time.perf_counter()
        for _ in range(args.calls):
            cache.evict(1)
        us = 1e6 * (time.perf_counter() - start) / args.calls
        runs.append(dict(pages=args.pages, held=held, calls=args.calls, evict_us=us))
        print(f"{args.pages} cached pages, the oldest {held} held: evict(1) {us:.1f} us a call")
    if args.out:
        print("wrote", write_result(args.out, {"runs": runs}, benchmark="prefix_evict.py"))


if __name__ == "__main__":
    main()
