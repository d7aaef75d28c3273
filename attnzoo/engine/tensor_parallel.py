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

import datetime
import os
import pickle
import socket
import weakref

import numpy as np
import torch

from attnzoo.engine.runner import Step
from attnzoo.errors import AttnzooError, ModelLoadError
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
        self.workers: list = []
        self.models: dict[int, TPGroup] = {}  # model id (load order, the same on every rank) -> its group
        self.loaded = 0
        self.closed = False

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

        dist.broadcast_object_list([message], src=0, group=self.control)

    def next(self) -> tuple[int | None, str, object]:
        """Ranks other than 0: run rank 0's steps, each on its model's engine, until another message."""
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            model_id, kind, payload = box[0]
            if kind != "step":
                if model_id in self.models:
                    self.models[model_id].tables.clear()
                    self.models[model_id].window_tables.clear()
                return model_id, kind, payload
            group = self.models[model_id]
            group.engine.run_step(Step(**group.decode(payload)))

    def shut(self, *, abort: bool) -> None:
        """Rank 0 of a spawned group: stop the other ranks (``abort``: at once, a load failed) and tear
        the process group down."""
        global _CHANNEL
        self.closed = True
        if _CHANNEL is self:
            _CHANNEL = None
        if abort:
            for p in self.workers:
                p.terminate()
        elif self.workers:
            try:
                self.broadcast((None, "shutdown", None))
            except Exception:  # a rank already gone: nothing left to tell
                pass
            for p in self.workers:
                p.join(timeout=60)
                if p.is_alive():
                    p.terminate()
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
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
        (steps of any model of the group: a teacher-forced comparison steps two)."""
        if not self.leader:
            model_id, kind, payload = self.channel.next()
            if (model_id, kind) != (self.model_id, "end"):
                raise ModelLoadError("rank 0 closed the tensor-parallel group, or called another model",
                                     fix="call generate/logits on every rank in the same order, before rank 0 closes")
            result, error = payload
            if error is not None:
                raise error
            return result
        try:
            result = fn()
        except BaseException as e:
            self.publish(("end", (None, _portable(e) if self.spmd else None)))
            raise
        self.publish(("end", (result if self.spmd else None, None)))
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
        if not self.leader or not channel.workers or channel.closed:
            return
        if abort or not channel.models:
            channel.shut(abort=abort)
        else:
            channel.broadcast((self.model_id, "drop", None))


def _portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles (to re-raise it on the other ranks), else its text."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return AttnzooError(f"rank 0 failed: {type(e).__name__}: {e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def launch(tensor_parallel_size: int | None, device, load_kwargs: dict) -> TPGroup | None:
    """Join (torchrun, spawned rank) or start (one process, N > 1) a tensor-parallel group; None: one process."""
    import torch.distributed as dist

    world_env = torchrun_world()
    if tensor_parallel_size is not None and (not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1):
        raise ModelLoadError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}",
                             fix="pass tensor_parallel_size=N with N >= 1")
    if world_env is None:
        n = tensor_parallel_size or 1
        if n == 1:
            return None
        if _CHANNEL is not None and _CHANNEL.live() and _CHANNEL.workers:
            return _join_spawned(_CHANNEL, n, device, load_kwargs)
        if dist.is_available() and dist.is_initialized():
            raise ModelLoadError("torch.distributed is already initialised in this process (another tensor-parallel model?)",
                                 fix="close the other model first (llm.close()), or launch with torchrun")
        dev = _rank_device(device, 0, n)
        port = _free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        workers = []
        for r in range(1, n):
            p = ctx.Process(target=_spawned_rank, args=(r, n, port, load_kwargs), daemon=True)
            p.start()
            workers.append(p)
        try:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=n, timeout=datetime.timedelta(minutes=10))
            group = _group(0, n, dev, spmd=False, owns_group=True)
        except BaseException:
            for p in workers:
                p.terminate()
            raise
        group.channel.workers[:] = workers
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
    elif dist.get_world_size() != world:
        raise ModelLoadError(f"torch.distributed's world has {dist.get_world_size()} ranks, WORLD_SIZE says {world}",
                             fix="initialise the default process group over all ranks, or leave it to attnzoo")
    return _group(rank, world, dev, spmd=os.environ.get(_SERVE_ENV) != "1", owns_group=owns)


def _group(rank: int, world: int, dev: torch.device, *, spmd: bool, owns_group: bool) -> TPGroup:
    import torch.distributed as dist

    global _CHANNEL
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    ctx = TPContext(rank=rank, world_size=world, group=dist.group.WORLD)
    _CHANNEL = _Channel(ctx, control, dev, spmd=spmd, owns_group=owns_group)
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
    channel.broadcast((None, "load", load_kwargs))
    return channel.join()


def _spawned_rank(rank: int, world: int, port: int, load_kwargs: dict) -> None:
    """Rank ``rank`` of a group started by load_model in one process: the torchrun route, then serve."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **{_SERVE_ENV: "1"})
    device = load_kwargs.get("device")
    if str(device).startswith("cpu") or (device is None and not torch.cuda.is_available()):
        # CPU ranks share the machine's cores with rank 0.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from attnzoo.engine.llm import load_model

    first = load_model(**load_kwargs)
    models, channel = {first.tp.model_id: first}, first.tp.channel
    try:
        while True:  # rank 0's steps run inside next(); other messages come out of it
            model_id, kind, payload = channel.next()
            if kind == "shutdown":
                break
            if kind == "load":
                llm = load_model(**payload)
                models[llm.tp.model_id] = llm
            elif kind == "drop":
                models.pop(model_id).tp.close()
            # "end": a call on rank 0 ended (its result stays there)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def register_close(llm, group: TPGroup) -> None:
    """Register the model's engine with its group (the other ranks run its steps on it), and stop a
    spawned group when its LLM is garbage-collected or the interpreter exits."""
    group._engine = weakref.ref(llm.engine)
    if group.workers and group.leader:
        weakref.finalize(llm, group.close)
