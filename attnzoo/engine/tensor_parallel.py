"""Tensor-parallel process groups: rank 0 driving the others step by step (started by ``launch``).

Two routes lead to the same group of N processes (one per GPU with NCCL, or N CPU processes on gloo):

- ``load_model(..., tensor_parallel_size=N)`` in one Python process: that process is rank 0 and spawns
  ranks 1..N-1 (torch.multiprocessing), which build the same model and run rank 0's steps until it is
  closed (``LLM.close()``, or at interpreter exit).
- ``torchrun --nproc-per-node N script.py``: every process runs the script and calls ``load_model``
  (``tensor_parallel_size`` defaults to WORLD_SIZE). On rank 0 the LLM works as usual; on the other
  ranks every ``generate`` / ``logits`` call follows rank 0's matching call (its own arguments are
  ignored) and returns rank 0's result, so one script runs unchanged on every rank.

Rank 0 alone schedules and samples. Before each forward pass it broadcasts the step (token ids, prefix
lengths, block tables, and its choices of graph replay and cascade) on a gloo group kept for this
control traffic; the others build the same metadata, run the same forward pass (whose all-reduces
meet rank 0's) and drop the logits. Several models can share one group (a second ``load_model`` with
the same size joins it; spawned ranks load it too): messages name their model, so rank 0 may step
them in any interleaving (teacher forcing steps runs A and B in lockstep). Each rank's KV pool holds its own heads at the page ids rank 0
hands out, so the pools are sized alike: the smallest page count any rank can afford.

Failures are the group's own: a rank that dies fails rank 0's call with a DistributedError naming it (and
every later call), an interrupt on rank 0 stops a call at a step boundary (``_Channel.interrupts``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import threading
import weakref

import numpy as np
import torch

from attnzoo.engine.ranks import LocalRanks
from attnzoo.engine.runner import Step
from attnzoo.errors import AttnzooError, DistributedError, ModelLoadError
from attnzoo.layers.parallel import TPContext

# Ranks 1..N-1 wait on the control group while rank 0 is idle (a user between calls): a collective
# timeout there would kill a healthy group.
_CONTROL_TIMEOUT = datetime.timedelta(days=30)
_NO_PAGES = np.zeros(0, dtype=np.int32)


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) from torchrun's environment, or None outside it."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ["WORLD_SIZE"])


class _Channel:
    """One process group and its control channel, shared by every model this process loads on it (run
    A and B of a teacher-forced comparison run side by side): messages name their model, and a rank
    following rank 0 runs each step on that model's engine."""

    def __init__(self, ctx: TPContext, control, device: torch.device, *, spmd: bool, owns_group: bool):
        import torch.distributed as dist

        self.ctx, self.control, self.device = ctx, control, device
        self.spmd = spmd  # torchrun: the other ranks' calls return rank 0's results
        self.owns_group = owns_group  # we initialised torch.distributed (spawn route): we tear it down
        self.world = dist.group.WORLD  # to notice a group torn down and started again by the caller
        self.ranks: LocalRanks | None = None  # the spawn route's other ranks, on rank 0
        self.models: dict[int, TPGroup] = {}  # model id (load order, the same on every rank) -> its group
        self.loaded = 0
        self.closed = False
        self.broken: DistributedError | None = None  # why every later call fails
        self.interrupted = False  # rank 0: SIGINT during a call; the next step boundary stops it
        self.forced = False  # rank 0: a second SIGINT stopped a step midway: the group cannot go on

    @property
    def workers(self) -> list:
        return [] if self.ranks is None else list(self.ranks.processes.values())

    def join(self) -> TPGroup:
        group = TPGroup(self, self.loaded)
        self.models[group.model_id] = group
        self.loaded += 1
        return group

    def live(self) -> bool:
        import torch.distributed as dist

        return not self.closed and dist.is_initialized() and dist.group.WORLD is self.world

    def broadcast(self, message) -> None:
        import torch.distributed as dist

        if message[1] == "step" and self.interrupted:
            # A step boundary: every rank has finished the last step and waits for this message, so the
            # call can stop here and leave the group in step (the caller tells the others it ended).
            raise KeyboardInterrupt
        dist.broadcast_object_list([message], group=self.control, group_src=0)

    def next(self) -> tuple[int | None, str, object]:
        """Ranks other than 0: run rank 0's steps, each on its model's engine, until another message."""
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, group=self.control, group_src=0)
            model_id, kind, payload = box[0]
            if kind == "warm_up":  # rank 0's Engine.warm_up: the backends' own, on this rank's kernels
                group = self.models[model_id]
                group.tables.clear()  # as rank 0's publish forgot what it sent (any kind but "step" does)
                group.window_tables.clear()
                group.engine.warm_up_backends()
                continue
            if kind != "step":
                if model_id in self.models:
                    self.models[model_id].tables.clear()
                    self.models[model_id].window_tables.clear()
                return model_id, kind, payload
            group = self.models[model_id]
            group.engine.run_step(Step(**group.decode(payload)))

    # ------------------------------------------------------------------ failures

    def check(self) -> None:
        """Raise the group's failure, if it has one (a rank died: named with its exit code and last error)."""
        if self.broken is None and self.ranks is not None:
            failed = self.ranks.failure()
            if failed is not None:
                self.fail(failed)
        if self.broken is not None:
            raise self.broken

    def failure_of(self, e: BaseException) -> DistributedError | None:
        """The group failure behind exception ``e`` (a collective that a dead rank closed), or None when the
        group is sound (an error of the call itself, or an interrupt that stopped at a step boundary)."""
        import torch.distributed as dist

        if self.broken is not None:
            return self.broken
        if isinstance(e, DistributedError):
            return e
        comm = isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e).lower())
        failed = self.ranks.failure(grace=5.0 if comm else 0.0) if self.ranks is not None else None
        if failed is None and comm:
            failed = DistributedError(f"a collective of the tensor-parallel group failed: {e}",
                                      fix="read the failing rank's error (torchrun names it), then start the group again")
        if failed is None and self.forced:
            failed = DistributedError("a second interrupt stopped the tensor-parallel group in the middle of a step, "
                                      "so its ranks no longer agree on where they are; it was closed",
                                      fix="load the model again (one interrupt stops a call cleanly at the next step)")
        return failed

    def fail(self, error: DistributedError) -> None:
        """The group cannot go on: remember why (every later call raises it), stop the ranks we started."""
        if self.broken is None:
            self.broken = DistributedError(f"{error.problem}; the group is closed", fix=error.fix or
                                           "load the model again", rank=error.rank, exitcode=error.exitcode)
        if self.ranks is not None or self.owns_group:
            self.shut(abort=True)

    @contextlib.contextmanager
    def interrupts(self):
        """Rank 0 during a call: the first SIGINT stops the call at the next step boundary (the step in
        flight finishes on every rank and is dropped), a second one at once (the group is then closed)."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield  # another thread, an enclosing call, or the user's own handler: leave SIGINT alone
            return
        self.interrupted = self.forced = False

        def on_sigint(signum, frame):
            if self.interrupted:
                self.forced = True
                raise KeyboardInterrupt
            self.interrupted = True

        signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def shut(self, *, abort: bool) -> None:
        """Rank 0 of a spawned group: stop the other ranks (``abort``: at once, a load failed) and tear
        the process group down."""
        global _CHANNEL
        self.closed = True
        if _CHANNEL is self:
            _CHANNEL = None
        if self.ranks is not None:
            if abort:
                self.ranks.terminate()
            else:
                try:
                    self.broadcast((None, "shutdown", None))
                except Exception:  # a rank already gone: nothing left to tell
                    pass
                self.ranks.join(timeout=60)
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                if abort:  # a dead peer's collectives would hang a plain destroy on NCCL
                    with contextlib.suppress(Exception):
                        dist.distributed_c10d._abort_process_group()
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


# This process's channel while it is open: a second tensor-parallel model joins it.
_CHANNEL: _Channel | None = None


class TPGroup:
    """One model's place in a tensor-parallel group, and its messages on the group's control channel."""

    def __init__(self, channel: _Channel, model_id: int):
        self.channel, self.model_id = channel, model_id
        self.ctx, self.device, self.spmd = channel.ctx, channel.device, channel.spmd
        self._engine = None  # weak reference to this rank's engine for the model, once it is built
        self.closed = False
        # Block tables only grow during a call: steps carry each request's new pages (request key ->
        # pages sent so far on rank 0, the tables rebuilt on the others), not 1024 x 100 page ids.
        self._sent: dict[int, int] = {}
        self.tables: dict[int, np.ndarray] = {}
        # Window-group tables (a pool with a window page group) also lose pages at the front, as the window
        # moves on: steps carry (first live column, new pages).
        self._wsent: dict[int, int] = {}
        self.window_tables: dict[int, np.ndarray] = {}

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def leader(self) -> bool:
        return self.ctx.rank == 0

    @property
    def workers(self) -> list:
        return self.channel.workers

    @property
    def spawned(self) -> bool:
        """Rank 0 of a group it started (spawn route): it stops the other ranks when done."""
        return self.channel.ranks is not None

    @property
    def engine(self):
        # Weak: a model dropped without close() (torchrun scripts) is freed as usual.
        return None if self._engine is None else self._engine()

    # ------------------------------------------------------------------ control channel

    def publish(self, message) -> None:
        kind, payload = message
        for key in (payload.get("gone") or ()) if kind == "step" else ():
            self._sent.pop(key, None)
            self._wsent.pop(key, None)
        if kind == "step" and payload.get("keys") is not None:
            new = []
            for key, table in zip(payload["keys"], payload["block_tables"]):  # int32 arrays (Request.page_table)
                new.append(table[self._sent.get(key, 0):].tolist())
                self._sent[key] = len(table)
            payload = {**payload, "block_tables": new}
            if payload.get("window_block_tables") is not None:
                wnew = []
                for key, table in zip(payload["keys"], payload["window_block_tables"]):
                    first = int(np.argmax(table != 0)) if table.any() else len(table)
                    wnew.append((first, table[self._wsent.get(key, 0):].tolist()))
                    self._wsent[key] = len(table)
                payload["window_block_tables"] = wnew
        elif kind != "step":
            self._sent.clear()
            self._wsent.clear()
        self.channel.broadcast((self.model_id, kind, payload))

    def decode(self, payload: dict) -> dict:
        """A step as rank 0 published it -> the step with whole block tables."""
        for key in payload.get("gone") or ():  # requests that ended: a long-running server never reuses keys
            self.tables.pop(key, None)
            self.window_tables.pop(key, None)
        if payload.get("keys") is not None:
            for key, pages in zip(payload["keys"], payload["block_tables"]):
                if pages or key not in self.tables:
                    old = self.tables.get(key, _NO_PAGES)
                    self.tables[key] = np.concatenate([old, np.asarray(pages, dtype=np.int32)])
            payload["block_tables"] = [self.tables[key] for key in payload["keys"]]
            if payload.get("window_block_tables") is not None:
                for key, (first, pages) in zip(payload["keys"], payload["window_block_tables"]):
                    if pages or key not in self.window_tables:
                        old = self.window_tables.get(key, _NO_PAGES)
                        self.window_tables[key] = np.concatenate([old, np.asarray(pages, dtype=np.int32)])
                    self.window_tables[key][:first] = 0
                payload["window_block_tables"] = [self.window_tables[key] for key in payload["keys"]]
        return payload

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (KV pages each GPU can hold)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel.control)
        return int(t.item())

    # ------------------------------------------------------------------ calls

    def call(self, fn):
        """Run an API call on rank 0 (then tell the others it ended), or follow rank 0's on the others
        (steps of any model of the group: a teacher-forced comparison steps two). A failed rank fails the
        call with a DistributedError, as it does every later call; an interrupt on rank 0 stops the call
        at a step boundary and the group goes on (``_Channel.interrupts``)."""
        if self.closed:
            raise DistributedError("this model was closed (llm.close()), which stopped its tensor-parallel ranks",
                                   fix="load the model again to use it")
        channel = self.channel
        channel.check()
        if not self.leader:
            try:
                model_id, kind, payload = channel.next()
            except BaseException as e:
                failed = channel.failure_of(e)
                if failed is None:
                    raise
                channel.fail(failed)
                raise channel.broken from e
            if (model_id, kind) != (self.model_id, "end"):
                raise ModelLoadError("rank 0 closed the tensor-parallel group, or called another model",
                                     fix="call generate/logits on every rank in the same order, before rank 0 closes")
            result, error = payload
            if error is not None:
                raise error
            return result
        with channel.interrupts():
            try:
                result = fn()
            except BaseException as e:
                failed = channel.failure_of(e)
                if failed is None:
                    self._end(None, e)
                    raise
                channel.fail(failed)
                if isinstance(e, KeyboardInterrupt):
                    raise
                raise channel.broken from e
            self._end(result, None)
            if channel.interrupted:  # after the last step: the call is done, the interrupt still stands
                raise KeyboardInterrupt
        return result

    def _end(self, result, error: BaseException | None) -> None:
        """Rank 0: tell the others the call ended (with its result or error under torchrun)."""
        try:
            self.publish(("end", (result if self.spmd else None, None if error is None or not self.spmd
                                  else portable(error))))
        except Exception as e:  # a rank died after the call's last step
            failed = self.channel.failure_of(e)
            if failed is None:
                raise
            self.channel.fail(failed)
            raise self.channel.broken from e

    def close(self, *, abort: bool = False) -> None:
        """Done with this model: rank 0 of a spawned group tells the other ranks to drop it, and stops them
        (``abort``: at once, the load failed) when it was the group's last model. Under torchrun the
        process group lives as long as the processes (every rank's script closes alike, or not at all)."""
        if self.closed:
            return
        self.closed = True
        channel = self.channel
        channel.models.pop(self.model_id, None)
        if not self.leader or not self.spawned or channel.closed:
            return
        if abort or not channel.models:
            channel.shut(abort=abort)
        else:
            try:
                channel.broadcast((self.model_id, "drop", None))
            except Exception as e:
                failed = channel.failure_of(e)
                channel.fail(failed or DistributedError(f"closing a model failed: {e}", fix="load the models again"))


def portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles (to re-raise it on the other ranks), else its text."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return AttnzooError(f"rank 0 failed: {type(e).__name__}: {e}")


def current() -> _Channel | None:
    """This process's open channel (a second model joins it), or None."""
    return _CHANNEL if _CHANNEL is not None and _CHANNEL.live() else None


def open_channel(ctx: TPContext, control, dev: torch.device, *, spmd: bool, owns_group: bool, ranks) -> TPGroup:
    """This process's channel from now on, and the first model's place in it."""
    global _CHANNEL
    _CHANNEL = _Channel(ctx, control, dev, spmd=spmd, owns_group=owns_group)
    _CHANNEL.ranks = ranks
    return _CHANNEL.join()


def forget(channel: _Channel | None) -> None:
    """``channel`` (None: any) is closed: a later load starts a new group."""
    global _CHANNEL
    if channel is None or _CHANNEL is channel:
        _CHANNEL = None


def register_close(llm, group: TPGroup) -> None:
    """Register the model's engine with its group (the other ranks run its steps on it), and stop a
    spawned group when its LLM is garbage-collected or the interpreter exits."""
    group._engine = weakref.ref(llm.engine)
    if group.spawned and group.leader:
        weakref.finalize(llm, group.close)
