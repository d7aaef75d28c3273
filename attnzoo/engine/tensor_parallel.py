"""Tensor-parallel process groups: starting the ranks, and rank 0 driving the others step by step.

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

from attnzoo.engine.ranks import LocalRanks, loopback_gloo, rank_main
from attnzoo.errors import AttnzooError, DistributedError, ModelLoadError
from attnzoo.layers.parallel import TPContext

# Ranks 1..N-1 wait on the control group while rank 0 is idle (a user between calls): a collective
# timeout there would kill a healthy group.
_CONTROL_TIMEOUT = datetime.timedelta(days=30)
_SERVE_ENV = "ATTNZOO_TP_SERVE"  # set in spawned ranks: serve rank 0 until shutdown, return nothing
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
        self.data = None  # data parallel: this replica's place among the replicas (attnzoo.engine.data_parallel)

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
            if kind != "step":
                if model_id in self.models:
                    self.models[model_id].tables.clear()
                    self.models[model_id].window_tables.clear()
                return model_id, kind, payload
            group = self.models[model_id]
            group.engine.run_step(group.decode(payload))

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
        self.interrupted = self.forced = False
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield  # another thread, or the user's own handler: leave SIGINT alone
            return

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
                if failed is not None:
                    channel.fail(failed)
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    raise channel.broken from e
                self.publish(("end", (None, _portable(e) if self.spmd else None)))
                raise
            self.publish(("end", (result if self.spmd else None, None)))
            if channel.interrupted:  # after the last step: the call is done, the interrupt still stands
                raise KeyboardInterrupt
        return result

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


def _portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles (to re-raise it on the other ranks), else its text."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return AttnzooError(f"rank 0 failed: {type(e).__name__}: {e}")


def _rank_device(device, local_rank: int, gpus_needed: int) -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ModelLoadError(f"tensor parallelism runs on CUDA GPUs or the CPU, not {dev}", fix="pass device='cuda' or 'cpu'")
    if dev.index is not None:
        raise ModelLoadError(f"device {str(dev)!r} names one GPU, but each tensor-parallel rank takes its own",
                             fix="pass device='cuda': rank r uses cuda:r (cuda:LOCAL_RANK under torchrun)")
    if torch.cuda.device_count() < gpus_needed:
        raise ModelLoadError(f"tensor parallelism needs {gpus_needed} GPUs here, {torch.cuda.device_count()} are visible",
                             fix="lower tensor_parallel_size, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


def launch(tensor_parallel_size: int | None, device, load_kwargs: dict, load) -> TPGroup | None:
    """Join (torchrun, spawned rank, a data-parallel replica) or start (one process, N > 1) a tensor-parallel
    group; None: one process. ``load(**load_kwargs)`` is what a spawned rank runs to build each model
    (``load_model``: passed down, so this module never imports the engine's API)."""
    import torch.distributed as dist

    world_env = torchrun_world()
    if tensor_parallel_size is not None and (not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1):
        raise ModelLoadError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}",
                             fix="pass tensor_parallel_size=N with N >= 1")
    replicas = load_kwargs.get("data_parallel_size") or 1
    if world_env is None or replicas > 1:
        n = tensor_parallel_size or 1
        if replicas > 1:  # attnzoo.engine.data_parallel built this replica's group, if it has one
            return _CHANNEL.join() if n > 1 and _CHANNEL is not None and _CHANNEL.live() else None
        if n == 1:
            return None
        if _CHANNEL is not None and _CHANNEL.live() and _CHANNEL.ranks is not None:
            return _join_spawned(_CHANNEL, n, device, load_kwargs)
        if dist.is_available() and dist.is_initialized():
            raise ModelLoadError("torch.distributed is already initialised in this process (another tensor-parallel model?)",
                                 fix="close the other model first (llm.close()), or launch with torchrun")
        dev = _rank_device(device, 0, n)
        ranks = LocalRanks(n, _spawned_rank, (load, load_kwargs))
        try:
            group = start_world(ranks, dev, tensor_parallel_size=n)
        except BaseException:
            ranks.terminate()
            raise
        return group

    rank, local_rank, world = world_env
    if tensor_parallel_size not in (None, world):
        raise ModelLoadError(f"tensor_parallel_size={tensor_parallel_size} but torchrun started {world} processes",
                             fix=f"pass tensor_parallel_size={world} (or leave it unset), or run torchrun --nproc-per-node "
                                 f"{tensor_parallel_size}")
    dev = _rank_device(device, local_rank, local_rank + 1)
    if _CHANNEL is not None and _CHANNEL.live():  # a second model on this process group
        if _CHANNEL.device != dev:
            raise ModelLoadError(f"this rank's tensor-parallel group runs on {_CHANNEL.device}, not {dev}",
                                 fix="load every model of the group on the same device")
        return _CHANNEL.join()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dist.get_world_size() != world:
        raise ModelLoadError(f"torch.distributed's world has {dist.get_world_size()} ranks, WORLD_SIZE says {world}",
                             fix="initialise the default process group over all ranks, or leave it to attnzoo")
    spawned = os.environ.get(_SERVE_ENV) == "1"
    return groups(rank, world, world, dev, spmd=not spawned, owns_group=owns or spawned)


def start_world(ranks: LocalRanks | None, dev: torch.device, *, tensor_parallel_size: int, replicas: int = 1):
    """Rank 0 of a group it spawned: wait for every rank to start (a dead one fails fast, named), then
    initialise torch.distributed on the loopback and build the groups (``groups``)."""
    import torch.distributed as dist

    world = tensor_parallel_size * replicas
    ranks.wait_joined()
    # A rank dying from here on closes its sockets: the collective waiting on it fails (gloo), or the
    # watcher interrupts the main thread (a rank that fails while rank 0 loads its own part).
    main = threading.main_thread()
    ranks.on_death.append(lambda rank: main.is_alive() and _interrupt_main_if_loading())
    with _loopback_gloo():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=ranks.store, rank=0, world_size=world,
                                timeout=datetime.timedelta(minutes=10))
        return groups(0, world, tensor_parallel_size, dev, spmd=False, owns_group=True, ranks=ranks)


_LOADING = threading.Event()  # rank 0's main thread is loading a model of a spawned group


def _interrupt_main_if_loading() -> None:
    if _LOADING.is_set():
        import _thread

        _thread.interrupt_main()


@contextlib.contextmanager
def loading(group: TPGroup | None):
    """Rank 0 of a spawned group loading a model: a rank that dies meanwhile interrupts the load at once
    (rank 0 would otherwise load its whole part before a collective notices), and the load fails with
    that rank's error."""
    watch = group is not None and group.leader and threading.current_thread() is threading.main_thread()
    if watch:
        _LOADING.set()
    try:
        yield
    except BaseException as e:
        failed = None if group is None else group.channel.failure_of(e)
        if failed is not None:
            group.channel.fail(failed)
            raise group.channel.broken from e
        raise
    finally:
        _LOADING.clear()


@contextlib.contextmanager
def _loopback_gloo():
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    loopback_gloo(os.environ)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def groups(rank: int, world: int, tensor_parallel_size: int, dev: torch.device, *, spmd: bool, owns_group: bool,
           ranks: LocalRanks | None = None) -> TPGroup | None:
    """Every rank alike (the same groups in the same order): one tensor-parallel group and its gloo control
    group per replica of ``tensor_parallel_size`` consecutive ranks. Sets this rank's channel and returns
    its place in it (None: replicas of one rank each)."""
    import torch.distributed as dist

    global _CHANNEL
    tp = tensor_parallel_size
    if tp == 1:
        return None
    mine = None
    for first in range(0, world, tp):
        members = list(range(first, first + tp))
        forward = dist.group.WORLD if tp == world else dist.new_group(members)
        control = dist.new_group(members, backend="gloo", timeout=_CONTROL_TIMEOUT)
        if rank in members:
            mine = forward, control
    ctx = TPContext(rank=rank % tp, world_size=tp, group=mine[0])
    _CHANNEL = _Channel(ctx, mine[1], dev, spmd=spmd, owns_group=owns_group)
    _CHANNEL.ranks = ranks
    return _CHANNEL.join()


def _join_spawned(channel: _Channel, n: int, device, load_kwargs: dict) -> TPGroup:
    """Rank 0 of a spawned group loads another model: the other ranks load it too, in the same order."""
    if n != channel.ctx.world_size:
        raise ModelLoadError(f"a tensor-parallel group of {channel.ctx.world_size} processes is running here, and "
                             f"tensor_parallel_size={n} asks for another size",
                             fix=f"close its models first (llm.close()), or pass tensor_parallel_size="
                                 f"{channel.ctx.world_size}")
    dev = _rank_device(device, 0, n)
    if dev != channel.device:
        raise ModelLoadError(f"the running tensor-parallel group is on {channel.device}, not {dev}",
                             fix="load every model of the group on the same device, or close its models first")
    channel.check()
    channel.broadcast((None, "load", load_kwargs))
    return channel.join()


def _spawned_rank(rank: int, world: int, host: str, port: int, load, load_kwargs: dict) -> None:
    """Rank ``rank`` of a group started by load_model in one process: the torchrun route, then serve."""
    import torch.distributed as dist

    store = rank_main(rank, world, host, port)
    os.environ[_SERVE_ENV] = "1"
    device = load_kwargs.get("device")
    dev = _rank_device(device, rank, rank + 1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    if str(device).startswith("cpu") or (device is None and not torch.cuda.is_available()):
        # CPU ranks share the machine's cores with rank 0.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    first = load(**load_kwargs)
    follow(first.tp.channel, load, {first.tp.model_id: first})


def forget(channel: _Channel | None) -> None:
    """``channel`` (None: any) is closed: a later load starts a new group."""
    global _CHANNEL
    if channel is None or _CHANNEL is channel:
        _CHANNEL = None


def follow(channel: _Channel, load, models: dict, *, destroy: bool = True) -> None:
    """A rank other than its group's rank 0: serve rank 0's models (load, step, drop) until it shuts the group."""
    try:
        while True:  # rank 0's steps run inside next(); other messages come out of it
            model_id, kind, payload = channel.next()
            if kind == "shutdown":
                break
            if kind == "load":
                llm = load(**payload)
                models[llm.tp.model_id] = llm
            elif kind == "drop":
                models.pop(model_id).tp.close()
            # "end": a call on rank 0 ended (its result stays there)
    finally:
        import torch.distributed as dist

        forget(channel)
        if destroy and dist.is_initialized():
            dist.destroy_process_group()


def register_close(llm, group: TPGroup) -> None:
    """Register the model's engine with its group (the other ranks run its steps on it), and stop a
    spawned group when its LLM is garbage-collected or the interpreter exits."""
    group._engine = weakref.ref(llm.engine)
    if group.spawned and group.leader:
        weakref.finalize(llm, group.close)
