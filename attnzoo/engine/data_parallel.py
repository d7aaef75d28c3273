"""Data parallel: N replicas of a model, each a tensor-parallel group of T ranks, over torch.distributed.

The world holds N x T ranks; replica k is ranks k*T .. k*T+T-1 and its leader is rank k*T. Two routes lead
to the same world: ``load_model(..., data_parallel_size=N)`` in one process (it is rank 0 and spawns the
others, ``attnzoo.engine.ranks``), or ``torchrun --nproc-per-node N*T`` with every rank calling
``load_model`` alike (then ranks other than 0 serve inside the call and return None when rank 0 closes
the model: guard the script's work with ``if llm is not None``).

Rank 0 coordinates and returns a ``DataParallelLLM``. Its ``replicas`` are ``Replica`` handles, one per
replica: replica 0 runs in this process; replica k >= 1 is reached on a gloo group of two ranks {0, k*T} of
its own, so calls to different replicas run at once (one thread each) and a caller may dispatch to one
replica without the others (a server balancing requests). ``generate`` shards its prompts over the
replicas in contiguous blocks and returns the outputs in input order, seeds fixed per output beforehand:
the result does not depend on N. A rank that dies fails the call within seconds, named.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import os
import threading
import weakref

import torch

from attnzoo.engine import launch as tp_launch, tensor_parallel
from attnzoo.engine.load_config import LoadConfig
from attnzoo.engine.ranks import LocalRanks, rank_main
from attnzoo.errors import AttnzooError, DistributedError, ModelLoadError

_TIMEOUT = datetime.timedelta(days=30)  # replicas wait for rank 0's next call as long as the user likes


class Replica:
    """One replica, as rank 0 sees it: ``call(method, *args, **kwargs)`` runs an LLM method there."""

    def __init__(self, index: int, leader: int, *, llm=None, group=None, owner: "DataParallelLLM"):
        self.index, self.leader = index, leader  # leader: its rank 0's global rank
        self._llm, self._group, self._owner = llm, group, owner
        self._lock = threading.Lock()  # one call at a time on the pair group

    @property
    def local(self) -> bool:
        return self._llm is not None

    def call(self, method: str, *args, **kwargs):
        if self.local:
            return getattr(self._llm, method)(*args, **kwargs)
        import torch.distributed as dist

        with self._lock:
            self._owner.check()
            try:
                dist.broadcast_object_list([("call", method, args, kwargs)], group=self._group, group_src=0)
                box = [None]
                dist.broadcast_object_list(box, group=self._group, group_src=1)
            except Exception as e:
                raise self._owner.fail(e, self) from e
        result, error = box[0]
        if error is not None:
            if isinstance(error, DistributedError):  # its group broke: name the rank that died, if one did
                raise self._owner.fail(error, self)
            raise error
        return result

    def generate(self, prompts, **kwargs):
        return self.call("generate", prompts, **kwargs)


class DataParallelLLM:
    """Rank 0's handle on N replicas: ``generate`` spreads prompts over them; everything else (tokenizer,
    config, ``logits``, ``info``) is replica 0's."""

    def __init__(self, llm, groups: list, tensor_parallel_size: int, ranks: LocalRanks | None, owns_world: bool):
        self.local = llm
        self.replicas = [Replica(0, 0, llm=llm, owner=self)] + [
            Replica(k, k * tensor_parallel_size, group=g, owner=self) for k, g in enumerate(groups, start=1)]
        self._ranks = ranks
        self._broken: DistributedError | None = None
        self._closed = False
        self._local_busy = False  # the main thread runs replica 0's share of a call
        self._broken_flag: list = []  # non-empty once broken (read by the finalizer, which holds no self)
        self._finalizer = weakref.finalize(self, _shut, groups, llm, ranks, owns_world, self._broken_flag)
        if ranks is not None:
            ranks.on_death.append(lambda rank: self._interrupt_local())
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(groups)), thread_name_prefix="attnzoo-replica")

    def __getattr__(self, name):  # tokenizer, config, source, decision, device, engine, model ...: replica 0's
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ failures

    def check(self) -> None:
        if self._closed:
            raise DistributedError("this model was closed (llm.close()), which stopped its data-parallel replicas",
                                   fix="load the model again to use it")
        if self._broken is None and self._ranks is not None:
            failed = self._ranks.failure()
            if failed is not None:
                self._break(failed)
        if self._broken is not None:
            raise self._broken

    def fail(self, e: BaseException, replica: Replica) -> DistributedError:
        """The error a broken replica fails the call with (a dead rank named with its exit code and last
        error, where this process started it); every later call raises it too."""
        failed = self._ranks.failure(grace=5.0) if self._ranks is not None else None
        if not replica.local:
            self._interrupt_local()
        if failed is None:
            failed = e if isinstance(e, DistributedError) else DistributedError(
                f"data-parallel replica {replica.index} (rank {replica.leader}) stopped answering: {e}",
                fix="read that rank's error (torchrun names the failed rank), then load the model again",
                rank=replica.leader)
        self._break(failed)
        return self._broken

    def _interrupt_local(self) -> None:
        """A replica failed while the main thread runs replica 0's share: stop that share now (it would run
        to its end before the failure is reported: minutes of an evaluation)."""
        if self._local_busy:
            import _thread

            _thread.interrupt_main()

    def _break(self, failed: DistributedError) -> None:
        if self._broken is None:
            self._broken = DistributedError(f"{failed.problem}; the replicas were stopped", fix=failed.fix,
                                            rank=failed.rank, exitcode=failed.exitcode)
            self._broken_flag.append(True)
            if self._ranks is not None:
                self._ranks.terminate()

    # ------------------------------------------------------------------ API

    def generate(self, prompts, *, seed=None, on_finish=None, num_return_sequences: int = 1, **kwargs):
        """``LLM.generate`` over the replicas: prompts in contiguous blocks, one block per replica, outputs in
        input order. An int ``seed`` becomes output i's ``seed + i`` before the split, as on one replica."""
        self.check()
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and isinstance(prompts[0], (int, dict)))
        batch = [prompts] if single else list(prompts) if isinstance(prompts, (list, tuple)) else prompts
        n = num_return_sequences
        if single or not isinstance(batch, list) or not batch or not isinstance(n, int) or n < 1:
            return self.local.generate(prompts, seed=seed, on_finish=on_finish, num_return_sequences=n, **kwargs)
        outs = len(batch) * n
        if isinstance(seed, int) and not isinstance(seed, bool):
            seed = [seed + i for i in range(outs)] if 0 <= seed <= 2**64 - outs else seed
        shards = _blocks(len(batch), len(self.replicas))
        futures = []
        for replica, (lo, hi) in zip(self.replicas, shards):
            if lo == hi:
                continue
            kw = dict(kwargs, num_return_sequences=n, seed=seed[lo * n:hi * n] if isinstance(seed, list) else seed)
            if replica.local:
                kw["on_finish"] = None if on_finish is None else (lambda i, base=lo * n: on_finish(base + i))
                futures.append((lo, replica, kw))
            else:
                futures.append((lo, replica, self._pool.submit(replica.generate, batch[lo:hi], **kw)))
        try:
            return self._collect(futures, batch, shards, n, on_finish)
        except KeyboardInterrupt as e:  # a replica failed (_interrupt_local) just as replica 0's share ended
            if self._broken is None:
                raise
            raise self._broken from e

    def _collect(self, futures, batch, shards, n, on_finish) -> list:
        results, error = [], None
        for lo, replica, job in futures:  # every replica's call ends before this one does
            try:
                if isinstance(job, dict):
                    self._local_busy = threading.current_thread() is threading.main_thread()
                    try:
                        part = replica.generate(batch[lo:lo + _size(shards, replica.index)], **job)
                    except KeyboardInterrupt as e:  # another replica failed (_interrupt_local), or the user
                        failed = self._broken or (self._ranks.failure(grace=1.0) if self._ranks else None)
                        if failed is None:
                            raise
                        raise self.fail(failed, replica) from e
                    finally:
                        self._local_busy = False
                else:
                    part = job.result()
                    if on_finish is not None:
                        for i in range(len(part)):
                            on_finish(lo * n + i)
                results.extend(part)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
        return results

    def logits(self, token_ids):
        self.check()
        return self.local.logits(token_ids)

    def info(self) -> dict:
        return {**self.local.info(), "data_parallel_size": len(self.replicas)}

    def close(self) -> None:
        """Stop every replica (also done when this object is collected, or at exit); later calls raise
        DistributedError."""
        self._closed = True
        self._pool.shutdown(wait=False)
        self._finalizer()


def _shut(pairs: list, local, ranks: LocalRanks | None, owns_world: bool, broken: list) -> None:
    """The replicas' leaders stop serving (their other ranks with them), then replica 0's ranks."""
    import torch.distributed as dist

    if not broken:
        for group in pairs:
            try:
                dist.broadcast_object_list([("shutdown", None, None, None)], group=group, group_src=0)
            except Exception:  # a replica already gone: the ranks are stopped below
                pass
    _close_replica(local)
    if ranks is not None:
        ranks.join(timeout=60)
    if owns_world and dist.is_initialized():
        dist.destroy_process_group()


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of ``parts`` contiguous blocks of ``n`` items, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (k < extra))
    return list(zip(bounds, bounds[1:]))


def _size(shards, index: int) -> int:
    lo, hi = shards[index]
    return hi - lo


def _close_replica(llm) -> None:
    """A replica's leader is done: its other ranks stop serving (whichever route started them)."""
    if llm.tp is not None and not llm.tp.closed:
        channel = llm.tp.channel
        llm.tp.closed = True
        if not channel.closed and channel.broken is None:
            try:
                channel.broadcast((None, "shutdown", None))
            except Exception:
                pass
        channel.closed = True
        tensor_parallel.forget(channel)


# ---------------------------------------------------------------------------------------- starting


def launch(name_or_path, cfg: LoadConfig, load_replica):
    """Start or join the world and load this rank's replica (``load_replica(name_or_path, cfg)``, the engine's
    loader, passed down). Rank 0: a DataParallelLLM. Other ranks (torchrun): serve, then None."""
    import torch.distributed as dist

    dp = cfg.data_parallel_size
    tp = cfg.tensor_parallel_size
    world_env = tensor_parallel.torchrun_world()
    if world_env is None:
        tp = tp or 1
        cfg = dataclasses.replace(cfg, tensor_parallel_size=tp)
        dev = tp_launch.rank_device(cfg.device, 0, dp * tp)
        if dist.is_available() and dist.is_initialized():
            raise ModelLoadError("torch.distributed is already initialised in this process (another parallel model?)",
                                 fix="close the other model first (llm.close()), or launch with torchrun")
        tp_launch.check_not_importing_main()
        ranks = LocalRanks(dp * tp, _spawned_rank, (load_replica, name_or_path, cfg), what="data-parallel")
        ranks.on_death.append(lambda rank: tp_launch.interrupt_main_if_loading())
        try:
            ranks.wait_joined()
            with tp_launch.loopback():
                dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=ranks.store, rank=0,
                                        world_size=dp * tp, timeout=datetime.timedelta(minutes=10))
                pairs = _groups(0, dp, tp, dev, ranks)
            tp_launch.LOADING.set()
            try:
                llm = load_replica(name_or_path, cfg)
                for group in pairs:  # every replica loaded, or the first one's error
                    _ready(group)
            finally:
                tp_launch.LOADING.clear()
        except BaseException as e:
            # A collective a dead rank closed, or the watcher's interrupt: wait for its exit to name it.
            plain = isinstance(e, AttnzooError) and not isinstance(e, DistributedError)
            failed = ranks.failure(grace=0.0 if plain else 5.0)
            ranks.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()
            tensor_parallel.forget(None)
            if failed is not None:
                raise failed from e
            raise
        return DataParallelLLM(llm, pairs, tp, ranks, owns_world=True)

    rank, local_rank, world = world_env
    tp = tp or world // dp
    cfg = dataclasses.replace(cfg, tensor_parallel_size=tp)
    if dp * tp != world:
        raise ModelLoadError(f"data_parallel_size={dp} x tensor_parallel_size={tp} is {dp * tp} ranks, but torchrun "
                             f"started {world}", fix=f"run torchrun --nproc-per-node {dp * tp}, or pass sizes whose "
                                                     f"product is {world}")
    dev = tp_launch.rank_device(cfg.device, local_rank, local_rank + 1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    pairs = _groups(rank, dp, tp, dev, None)
    return _serve_or_lead(rank, tp, pairs, load_replica, name_or_path, cfg, owns)


def _groups(rank: int, dp: int, tp: int, dev, ranks) -> list:
    """Every rank alike: the replicas' tensor-parallel groups, then one gloo pair {0, k*T} per replica k >= 1
    (rank 0: all of them; replica k's leader: its own, first in the list; others: none)."""
    import torch.distributed as dist

    tp_launch.groups(rank, dp * tp, tp, dev, spmd=False, owns_group=False, ranks=ranks)
    pairs = []
    for k in range(1, dp):
        g = dist.new_group([0, k * tp], backend="gloo", timeout=_TIMEOUT)
        if rank in (0, k * tp):
            pairs.append(g)
    return pairs


def _ready(group):
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, group=group, group_src=1)
    ok, payload = box[0]
    if not ok:
        raise payload
    return payload


def _serve_or_lead(rank: int, tp: int, pairs: list, load_replica, name_or_path, cfg: LoadConfig, owns: bool):
    import torch.distributed as dist

    if rank == 0:
        llm = load_replica(name_or_path, cfg)
        for g in pairs:
            _ready(g)
        return DataParallelLLM(llm, pairs, tp, None, owns_world=owns)
    leader = rank % tp == 0
    try:
        llm = load_replica(name_or_path, cfg)
    except BaseException as e:
        if leader:
            dist.broadcast_object_list([(False, tensor_parallel.portable(e))], group=pairs[0], group_src=1)
        raise
    if not leader:  # follow this replica's leader until it shuts its group
        tp_launch.follow(llm.tp.channel, None, {llm.tp.model_id: llm}, destroy=owns)
        return None
    dist.broadcast_object_list([(True, None)], group=pairs[0], group_src=1)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, group=pairs[0], group_src=0)
            kind, method, args, kwargs = box[0]
            if kind == "shutdown":
                break
            try:
                reply = (getattr(llm, method)(*args, **kwargs), None)
            except Exception as e:
                reply = (None, tensor_parallel.portable(e))
            dist.broadcast_object_list([reply], group=pairs[0], group_src=1)
    finally:
        _close_replica(llm)
        if owns and dist.is_initialized():
            dist.destroy_process_group()
    return None


def _spawned_rank(rank: int, world: int, host: str, port: int, load_replica, name_or_path, cfg: LoadConfig) -> None:
    import torch.distributed as dist

    store = rank_main(rank, world, host, port)
    dp = cfg.data_parallel_size
    tp = world // dp
    dev = tp_launch.rank_device(cfg.device, rank, rank + 1)
    if dev.type == "cpu":  # CPU ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    pairs = _groups(rank, dp, tp, dev, None)
    _serve_or_lead(rank, tp, pairs, load_replica, name_or_path, cfg, owns=True)
