"""Status lines on stderr: what loading and generation say while they run (``progress=True``, or by default
when stderr is a terminal)."""
from __future__ import annotations

import sys
import time


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def say(msg: str) -> None:
    print(f"attnzoo: {msg}", file=sys.stderr, flush=True)


class GenerationProgress:
    """``on_finish`` hook: a tqdm bar of finished sequences on a terminal, and a summary line."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.total, self.t0 = total, time.perf_counter()
        say(f"generating {total} sequence(s) ...")
        self.bar = tqdm(total=total, desc="attnzoo: generating", unit="seq", file=sys.stderr, leave=False,
                        disable=not stderr_is_terminal())

    def __call__(self, index: int) -> None:
        self.bar.update(1)

    def close(self, outs) -> None:
        self.bar.close()
        dt = time.perf_counter() - self.t0
        tokens = sum(len(o.token_ids) for o in outs)
        say(f"generated {tokens} tokens for {self.total} sequence(s) in {dt:.1f} s ({tokens / max(dt, 1e-9):.1f} tok/s)")
