"""Starting and joining tensor-parallel groups (the running group is ``tensor_parallel``'s).

Rank 0 of a spawned group starts the others (``ranks.LocalRanks``), waits until each has started (a dead one
fails it at once, named), then initialises torch.distributed on the loopback and builds the groups. Under
torchrun (or in a spawned rank) every process joins the same way. ``load(name_or_path, cfg)`` (the engine's
loader of one replica) is passed down to the ranks, so this package's modules import each other without a circle.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading

import torch

from attnzoo.engine import tensor_parallel
from attnzoo.engine.load_config import LoadConfig
from attnzoo.engine.ranks import LocalRanks, loopback_gloo, rank_main
from attnzoo.engine.tensor_parallel import _CONTROL_TIMEOUT, TPGroup, torchrun_world
from attnzoo.errors import ModelLoadError
from attnzoo.layers.parallel import TPContext

_SERVE_ENV = "ATTNZOO_TP_SERVE"  # set in spawned ranks: serve rank 0 until shutdown, return nothing


def rank_device(device, local_rank: int, gpus_needed: int) -> torch.device:
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


def launch(name_or_path, cfg: LoadConfig, load) -> TPGroup | None:
    """Join (torchrun, spawned rank, a data-parallel replica) or start (one process, N > 1) a tensor-parallel
    group; None: one process. ``load(name_or_path, cfg)`` is what a spawned rank runs to build each model
    (passed down, so this module never imports the engine's API)."""
    import torch.distributed as dist

    world_env = torchrun_world()
    tensor_parallel_size, device = cfg.tensor_parallel_size, cfg.device
    replicas = cfg.data_parallel_size or 1
    if world_env is None or replicas > 1:
        n = tensor_parallel_size or 1
        if replicas > 1:  # attnzoo.engine.data_parallel built this replica's group, if it has one
            return tensor_parallel.current().join() if n > 1 and tensor_parallel.current() is not None else None
        if n == 1:
            return None
        channel = tensor_parallel.current()
        if channel is not None and channel.ranks is not None:
            return _join_spawned(channel, n, name_or_path, cfg)
        if dist.is_available() and dist.is_initialized():
            raise ModelLoadError("torch.distributed is already initialised in this process (another tensor-parallel model?)",
                                 fix="close the other model first (llm.close()), or launch with torchrun")
        dev = rank_device(device, 0, n)
        check_not_importing_main()
        ranks = LocalRanks(n, _spawned_rank, (load, name_or_path, cfg))
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
    dev = rank_device(device, local_rank, local_rank + 1)
    channel = tensor_parallel.current()
    if channel is not None:  # a second model on this process group
        if channel.device != dev:
            raise ModelLoadError(f"this rank's tensor-parallel group runs on {channel.device}, not {dev}",
                                 fix="load every model of the group on the same device")
        return channel.join()
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


def check_not_importing_main() -> None:
    """A spawned rank imports the main script: one that loads a parallel model at import would start ranks
    from every rank."""
    import multiprocessing.process

    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise ModelLoadError("this spawned rank ran the main script's load_model while importing it (the script has "
                             "no `if __name__ == '__main__':` guard)",
                             fix="put the script's work under `if __name__ == '__main__':`, or launch it with torchrun")


def start_world(ranks: LocalRanks | None, dev: torch.device, *, tensor_parallel_size: int, replicas: int = 1):
    """Rank 0 of a group it spawned: wait for every rank to start (a dead one fails fast, named), then
    initialise torch.distributed on the loopback and build the groups (``groups``)."""
    import torch.distributed as dist

    world = tensor_parallel_size * replicas
    ranks.wait_joined()
    # A rank dying from here on closes its sockets: the collective waiting on it fails (gloo), or the
    # watcher interrupts the main thread (a rank that fails while rank 0 loads its own part).
    main = threading.main_thread()
    ranks.on_death.append(lambda rank: main.is_alive() and interrupt_main_if_loading())
    with loopback():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=ranks.store, rank=0, world_size=world,
                                timeout=datetime.timedelta(minutes=10))
        return groups(0, world, tensor_parallel_size, dev, spmd=False, owns_group=True, ranks=ranks)


LOADING = threading.Event()  # rank 0's main thread is loading a model of a spawned group


def interrupt_main_if_loading() -> None:
    if LOADING.is_set():
        import _thread

        _thread.interrupt_main()


@contextlib.contextmanager
def loading(group: TPGroup | None):
    """Rank 0 of a spawned group loading a model: a rank that dies meanwhile interrupts the load at once
    (rank 0 would otherwise load its whole part before a collective notices), and the load fails with
    that rank's error."""
    watch = group is not None and group.leader and threading.current_thread() is threading.main_thread()
    if watch:
        LOADING.set()
    try:
        yield
    except BaseException as e:
        failed = None if group is None else group.channel.failure_of(e)
        if failed is not None:
            group.channel.fail(failed)
            raise group.channel.broken from e
        raise
    finally:
        LOADING.clear()


@contextlib.contextmanager
def loopback():
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
    return tensor_parallel.open_channel(ctx, mine[1], dev, spmd=spmd, owns_group=owns_group, ranks=ranks)


def _join_spawned(channel: tensor_parallel._Channel, n: int, name_or_path, cfg: LoadConfig) -> TPGroup:
    """Rank 0 of a spawned group loads another model: the other ranks load it too, in the same order."""
    if n != channel.ctx.world_size:
        raise ModelLoadError(f"a tensor-parallel group of {channel.ctx.world_size} processes is running here, and "
                             f"tensor_parallel_size={n} asks for another size",
                             fix=f"close its models first (llm.close()), or pass tensor_parallel_size="
                                 f"{channel.ctx.world_size}")
    dev = rank_device(cfg.device, 0, n)
    if dev != channel.device:
        raise ModelLoadError(f"the running tensor-parallel group is on {channel.device}, not {dev}",
                             fix="load every model of the group on the same device, or close its models first")
    channel.check()
    channel.broadcast((None, "load", (name_or_path, cfg)))
    return channel.join()


def _spawned_rank(rank: int, world: int, host: str, port: int, load, name_or_path, cfg: LoadConfig) -> None:
    """Rank ``rank`` of a group started by load_model in one process: the torchrun route, then serve."""
    import torch.distributed as dist

    store = rank_main(rank, world, host, port)
    os.environ[_SERVE_ENV] = "1"
    device = cfg.device
    dev = rank_device(device, rank, rank + 1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    if str(device).startswith("cpu") or (device is None and not torch.cuda.is_available()):
        # CPU ranks share the machine's cores with rank 0.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    first = load(name_or_path, cfg)
    follow(first.tp.channel, load, {first.tp.model_id: first})


def follow(channel: tensor_parallel._Channel, load, models: dict, *, destroy: bool = True) -> None:
    """A rank other than its group's rank 0: serve rank 0's models (load, step, drop) until it shuts the group."""
    try:
        while True:  # rank 0's steps run inside next(); other messages come out of it
            model_id, kind, payload = channel.next()
            if kind == "shutdown":
                break
            if kind == "load":
                llm = load(*payload)  # (name_or_path, cfg)
                models[llm.tp.model_id] = llm
            elif kind == "drop":
                models.pop(model_id).tp.close()
            # "end": a call on rank 0 ended (its result stays there)
    finally:
        import torch.distributed as dist

        tensor_parallel.forget(channel)
        if destroy and dist.is_initialized():
            dist.destroy_process_group()
