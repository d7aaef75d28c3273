"""Ranks started from this process, and watching them: a rank that dies fails the caller within seconds.

``LocalRanks`` starts ranks 1..N-1 of a group on this host (spawned processes) around a setup store that
rank 0 hosts on 127.0.0.1 (``ATTNZOO_STORE_HOST`` to listen elsewhere: the group's control messages are
pickled, so nothing outside the host should reach them). Each rank's stderr passes through this process,
which keeps its last lines: a rank that dies is named with its exit code and its last error, whether it
died importing (a script run as ``python - < file``, or without an ``if __name__ == "__main__":`` guard),
at start (killed, out of memory) or while running. The ranks ignore SIGINT: rank 0 decides what an
interrupt stops and tells them (``tensor_parallel``).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time

from attnzoo.errors import DistributedError

STORE_HOST_ENV = "ATTNZOO_STORE_HOST"
_JOINED = "attnzoo/joined/"
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)(:|$)")
_SCRIPT_FIX = ("read rank {rank}'s error above. A script run as `python - < file`, or without an `if __name__ == "
               "'__main__':` guard, cannot start ranks (each spawned rank imports the main script): run it from a file "
               "under the guard, or launch every rank with torchrun")

_KILLED_FIX = ("if nobody killed it, the host ran out of memory (see `dmesg`): give the ranks less to hold (a smaller "
               "kv_cache_memory or model, fewer ranks per host), then load the model again")


def store_host() -> str:
    return os.environ.get(STORE_HOST_ENV, "127.0.0.1")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


class _Tail:
    """A rank's stderr: passed on to this process's stderr line by line, the last lines kept."""

    def __init__(self, read_fd: int, out_fd: int):
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self._fd, self._out = read_fd, out_fd
        self.thread = threading.Thread(target=self._pump, daemon=True, name="attnzoo-rank-stderr")
        self.thread.start()

    def _pump(self) -> None:
        pending = b""
        with os.fdopen(self._fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                with contextlib.suppress(OSError):
                    os.write(self._out, chunk)
                *done, pending = (pending + chunk).split(b"\n")
                self.lines.extend(line.decode(errors="replace").rstrip() for line in done)
        if pending:
            self.lines.append(pending.decode(errors="replace").rstrip())

    def last_error(self) -> str:
        """The last exception's type and message (its lines joined), else the last non-blank line."""
        self.thread.join(timeout=1.0)  # the rank is gone: its last lines are on their way
        lines = list(self.lines)
        for i in range(len(lines) - 1, -1, -1):
            if _EXCEPTION.match(lines[i]):
                text = " ".join(line.strip() for line in lines[i:] if line.strip())
                return text if len(text) <= 500 else text[:497] + "..."
        return next((line.strip() for line in reversed(lines) if line.strip()), "no error output")


@contextlib.contextmanager
def _child_start_state(err_fd: int):
    """While a rank starts: its stderr is ``err_fd`` and it inherits SIGINT ignored (Python keeps an ignored
    SIGINT, so a terminal's Ctrl-C reaches rank 0 alone)."""
    saved = os.dup(2)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        sys.stderr.flush()
        os.dup2(err_fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if main:
            signal.signal(signal.SIGINT, old)


class LocalRanks:
    """Ranks 1..world-1 of a group whose rank 0 is this process, each running
    ``target(rank, world, host, port, *args)`` (``rank_main`` is the usual target's first step)."""

    def __init__(self, world: int, target, args: tuple, *, what: str = "tensor-parallel"):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.world, self.what = world, what
        host = store_host()
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.bind((host, 0))
        self._listener.listen(world * 4)
        self.port = self._listener.getsockname()[1]
        self.store = dist.TCPStore(host, self.port, None, True, datetime.timedelta(minutes=10),
                                   wait_for_workers=False, master_listen_fd=self._listener.fileno())
        ctx = mp.get_context("spawn")
        out = os.dup(2)  # where the ranks' stderr goes on to
        self.processes, self.tails = {}, {}
        self.stopping = False
        self.on_death = []  # callbacks(rank) run by the watcher when a rank dies unexpectedly
        try:
            for r in range(1, world):
                read, write = os.pipe()
                with _child_start_state(write):
                    p = ctx.Process(target=target, args=(r, world, host, self.port, *args), daemon=True)
                    p.start()
                os.close(write)
                self.processes[r], self.tails[r] = p, _Tail(read, out)
        except BaseException:
            self.terminate()
            raise
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="attnzoo-rank-watcher")
        self._watcher.start()

    # ------------------------------------------------------------------ failures

    def dead(self) -> int | None:
        """The lowest rank that has exited, or None."""
        return next((r for r, p in self.processes.items() if p.exitcode is not None), None)

    def error(self, rank: int) -> DistributedError:
        p = self.processes[rank]
        killed = p.exitcode is not None and p.exitcode < 0
        fix = _KILLED_FIX if killed else _SCRIPT_FIX.format(rank=rank)
        return DistributedError(f"{self.what} rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}; its last error: "
                                f"{self.tails[rank].last_error()}", fix=fix, rank=rank, exitcode=p.exitcode)

    def failure(self, grace: float = 0.0) -> DistributedError | None:
        """The first dead rank's error; waits up to ``grace`` seconds for one (a collective failed: the
        peer that closed it may not be reaped yet)."""
        deadline = time.monotonic() + grace
        while True:
            r = self.dead()
            if r is not None:
                return self.error(r)
            if time.monotonic() >= deadline:
                return None
            multiprocessing.connection.wait([p.sentinel for p in self.processes.values()],
                                            timeout=max(0.0, deadline - time.monotonic()))

    def wait_joined(self, timeout: float = 600.0) -> None:
        """Until every rank has reached ``rank_main`` (imports done), failing fast on one that dies first."""
        keys = [f"{_JOINED}{r}" for r in self.processes]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            failed = self.failure(grace=0.05)
            if failed is not None:
                raise failed
            if time.monotonic() > deadline:
                raise DistributedError(f"{self.what} ranks did not start within {timeout:.0f} s",
                                       fix="check the ranks' output above; lower the group size if the host is short of memory")

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.processes.items()}
        while sentinels and not self.stopping:
            for s in multiprocessing.connection.wait(list(sentinels), timeout=1.0):
                rank = sentinels.pop(s)
                if not self.stopping:
                    for fn in list(self.on_death):
                        with contextlib.suppress(Exception):
                            fn(rank)

    # ------------------------------------------------------------------ stopping

    def join(self, timeout: float) -> None:
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.processes.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.terminate()

    def terminate(self) -> None:
        self.stopping = True
        for p in getattr(self, "processes", {}).values():
            if p.is_alive():
                p.terminate()
        for p in getattr(self, "processes", {}).values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(OSError):
            self._listener.close()


def rank_main(rank: int, world: int, host: str, port: int):
    """First step of a spawned rank: torchrun's environment, gloo on the loopback, and a check-in with
    rank 0's store. Returns the store, for ``init_process_group``."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=host,
                      MASTER_PORT=str(port))
    loopback_gloo(os.environ)
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(minutes=10))
    store.set(f"{_JOINED}{rank}", "1")
    return store


def loopback_gloo(env) -> None:
    """Gloo's own sockets (they carry the pickled control messages) on the loopback too, unless the user
    named an interface or the store listens elsewhere."""
    if store_host() in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in env:
        names = [name for _, name in socket.if_nameindex()]
        loop = next((n for n in ("lo", "lo0") if n in names), None)
        if loop is not None:
            env["GLOO_SOCKET_IFNAME"] = loop
