"""Rank targets for tests/test_dist_faults.py (each spawned rank imports this module by name)."""
from __future__ import annotations

import os
import signal

if os.environ.get("ATTNZOO_TEST_FAIL_IMPORT"):
    raise ImportError("dist_fault_ranks: this import fails on purpose")


def die_at_start(rank, world, host, port):
    os.kill(os.getpid(), signal.SIGKILL)


def raise_at_start(rank, world, host, port):
    raise ValueError(f"rank {rank} fails on purpose")


def check_in(rank, world, host, port):
    from attnzoo.engine.ranks import rank_main

    rank_main(rank, world, host, port)
