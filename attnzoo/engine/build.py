"""Building a loaded model's parts: the device and the policy resolved, weights read, the KV pool sized and
the engine made, in that order, so that nothing is read before everything that can be checked is (the
options were checked when their ``LoadConfig`` was made; ``llm.load_model`` wraps the result in an ``LLM``)."""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable

import torch
from transformers import PretrainedConfig

from attnzoo.attention.backends import get_backend_class
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.kv_cache import KVPool, kv_storage_dtype, wants_window_group, window_group_layers
from attnzoo.engine.compat import eos_ids as generation_eos_ids
from attnzoo.engine.compat import read_generation_config
from attnzoo.engine.engine import Engine, check_cascade
from attnzoo.engine import memory
from attnzoo.engine.load_config import LoadConfig
from attnzoo.engine.progress import say as say_line, stderr_is_terminal
from attnzoo.engine.scheduler import MAX_RUNNING_CAP
from attnzoo.errors import BackendError, ModelLoadError
from attnzoo.models import loader
from attnzoo.models.registry import model_class
from attnzoo.models.weights import plan_weights

log = logging.getLogger("attnzoo")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _pick_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fix = "pass device='cpu', 'cuda' or 'cuda:N' (or leave it unset: cuda when available)"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"device={device!r} is not a device torch knows", fix=fix) from None
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device={device!r}: attnzoo runs on CPUs and CUDA GPUs only", fix=fix)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but no CUDA GPU is available", fix="pass device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
                             fix=f"pass cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


def _pick_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":  # "auto": vLLM's spelling of the default
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}", fix=f"use one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _window_split(specs, context_len: int, window_kv_fraction) -> bool:
    """Whether the pool gets a window page group: sliding layers whose window is shorter than the context."""
    if window_kv_fraction is None or (window_kv_fraction == "auto" and not wants_window_group(specs)):
        return False
    windows = [specs[i].kept_window() for i in window_group_layers(specs)]
    return bool(windows) and context_len > max(windows)


def _kv_pages(specs, page_size, dtype, device, kv_cache_tokens, kv_cache_memory, context_len,
              window_kv_fraction=None, max_running=None, max_batch_tokens=2048,
              copy_per_token: int = 0) -> tuple[int, int | None]:
    """(full-group pages, window-group pages or None for one group), page 0 of each included.
    ``copy_per_token``: bytes the backends keep beside each token of the full group, charged to its pages."""
    copy_page = copy_per_token * page_size
    per_page = KVPool.bytes_per_page(specs, page_size, dtype) + copy_page
    split = _window_split(specs, context_len, window_kv_fraction)
    if kv_cache_tokens is not None and (not split or window_kv_fraction != "auto"):
        full = -(-kv_cache_tokens // page_size) + 1
        return full, (max(2, int(window_kv_fraction * (full - 1)) + 1) if split else None)
    if kv_cache_memory is None and kv_cache_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free * 0.85)
        else:
            # CPU: enough for several full-length sequences without eating the machine's memory.
            kv_cache_memory = min(1 << 30, per_page * (-(-8 * context_len // page_size)))
    if not split:
        return max(2, kv_cache_memory // per_page), None
    per_full = KVPool.bytes_per_page(specs, page_size, dtype, group="full") + copy_page
    per_window = KVPool.bytes_per_page(specs, page_size, dtype, group="window")
    if window_kv_fraction == "auto":
        return _auto_window_pages(specs, page_size, per_full, per_window, kv_cache_tokens, kv_cache_memory,
                                  context_len, max_running, max_batch_tokens)
    # full x per_full + fraction x full x per_window = memory
    full = int(kv_cache_memory // (per_full + window_kv_fraction * per_window))
    return max(2, full), max(2, int(window_kv_fraction * full))


def _profiled_kv_bytes(model, specs, ps, kv_dt, dt, dev, cfg, decision, context_len, max_batch_tokens, hidden,
                       say) -> int:
    """The default KV cache's bytes on a GPU (``engine.memory``): one step of ``max_batch_tokens`` prompt tokens
    (as many prompts as the context needs) run on a pool of just their pages."""
    longest = max(1, context_len - 1)  # a prompt and its one new token fit the context
    n = -(-max_batch_tokens // longest)
    lengths = [max_batch_tokens // n + (i < max_batch_tokens % n) for i in range(n)]
    # A fixed window fraction could leave a request too few window pages: this pool's groups are equal.
    fraction = cfg.window_kv_fraction if cfg.window_kv_fraction in (None, "auto") else 1.0
    pages, window_pages = _kv_pages(specs, ps, kv_dt, dev, max_batch_tokens + n * (ps + 1), None, context_len,
                                    fraction, n, max_batch_tokens)
    rows = cfg.max_running or min(MAX_RUNNING_CAP, max_batch_tokens)
    say(f"measuring a step's memory: {max_batch_tokens} prompt tokens in {n} prompt(s), then {rows} rows of "
        f"logits ...")
    pool = engine = None
    try:
        pool = KVPool(specs, num_pages=pages, page_size=ps, dtype=dt, device=dev, kv_cache_dtype=cfg.kv_cache_dtype,
                      k_scale=cfg.k_scale, v_scale=cfg.v_scale, num_window_pages=window_pages)
        engine = Engine(model, pool, HybridBackend.create(decision.prefill_backend, decision.decode_backend, pool),
                        context_len=context_len, max_batch_tokens=max_batch_tokens, max_running=n,
                        prefix_caching=False, cascade=False)
        peak = memory.step_peak_bytes(engine, lengths, rows, hidden, dt)
    except torch.OutOfMemoryError:
        raise ModelLoadError(
            f"out of GPU memory running one step of {max_batch_tokens} tokens before sizing the KV cache "
            f"({torch.cuda.mem_get_info(dev)[0] / 2**30:.1f} GiB free after the weights)",
            fix="pass a smaller max_batch_tokens (and max_running), or use more GPUs (tensor_parallel_size)") from None
    finally:
        del engine, pool
        torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    kv = memory.default_kv_bytes(free, peak)
    if kv <= 0:
        need = memory.STEP_MARGIN * peak + memory.HEADROOM
        raise ModelLoadError(
            f"no room for a KV cache: {free / 2**30:.1f} GiB are free after the weights and a step of "
            f"{max_batch_tokens} tokens needs {need / 2**30:.1f} GiB beside them (its measured peak, a margin "
            f"and {memory.HEADROOM / 2**30:.0f} GiB for graphs and workspaces)",
            fix="pass a smaller max_batch_tokens (and max_running), size the cache yourself (kv_cache_tokens or "
                "kv_cache_memory), or use more GPUs (tensor_parallel_size)")
    say(f"a step peaks at {peak / 2**30:.2f} GiB: the KV cache takes {kv / 2**30:.2f} GiB of the "
        f"{free / 2**30:.2f} GiB free ({memory.DEFAULT_FRACTION:.0%} at most)")
    return kv


def _capture_oom(pool: KVPool, max_running: int, sized_by_default: bool, copy_bytes: int = 0) -> ModelLoadError:
    """A decode step's activations at the largest captured batch did not fit beside the KV cache (and
    ``copy_bytes`` of the backends' own copy of it)."""
    how = ("at most 85% of the memory free after the weights, less a measured step, the default" if sized_by_default
           else "as asked")
    copy = f" (+ {copy_bytes / 2**30:.2f} GiB of the backend's own copy)" if copy_bytes else ""
    return ModelLoadError(
        f"out of GPU memory capturing the decode CUDA graphs (batches up to {max_running}): the KV cache took "
        f"{pool.nbytes / 2**30:.2f} GiB{copy} ({how}) and left too little for a step's activations",
        fix="leave more room beside the KV cache (gpu_memory_utilization=0.8, or a smaller kv_cache_memory or "
            "kv_cache_tokens), capture smaller batches (max_running=N), or pass cuda_graph=False")


def _decode_window_pages(specs, ps: int) -> int:
    """Window-group pages a decoding request holds at most: its window and a page (KVPages.window_peak)."""
    return -(-max(specs[i].kept_window() for i in window_group_layers(specs)) // ps) + 1


def _auto_window_pages(specs, ps, per_full, per_window, kv_cache_tokens, kv_cache_memory, context_len,
                       max_running, max_batch_tokens) -> tuple[int, int]:
    """window_kv_fraction="auto": a window group for ``max_running`` decoding requests' windows (None: as many
    requests as the memory holds of ``min(context, max_batch_tokens)`` tokens each, at most the scheduler's
    cap) and one request's largest prefill chunk, never more pages than the full group (a request's window
    peak is at most its full-group pages, so what the full group admits the window group does: no deadlock)."""
    window = max(specs[i].kept_window() for i in window_group_layers(specs))
    # What a request holds at most in the window group (KVPages.window_peak): decoding, its window and a
    # page; prefilling, its window and a chunk.
    ref = min(context_len, max_batch_tokens)
    decode, prefill = _decode_window_pages(specs, ps), -(-(window - 1 + ref) // ps) + 1
    runs = max_running if max_running is not None else min(MAX_RUNNING_CAP, max_batch_tokens)
    if kv_cache_tokens is not None:
        full = -(-kv_cache_tokens // ps)
        if max_running is None:
            runs = min(runs, max(1, full * ps // ref))
    else:
        kv_cache_memory -= per_full + per_window  # each group's page 0
        if max_running is None:
            runs = min(runs, max(1, int((kv_cache_memory - prefill * per_window)
                                        // (ref / ps * per_full + decode * per_window))))
        full = int((kv_cache_memory - (runs * decode + prefill) * per_window) // per_full)
    wpages = runs * decode + prefill
    if full <= wpages and kv_cache_tokens is None:  # little memory: both groups the same size
        full = wpages = int(kv_cache_memory // (per_full + per_window))
    return max(2, full + 1), max(2, min(wpages, full) + 1)


def build(name_or_path, cfg: LoadConfig, *, tp) -> dict:
    """The parts of a loaded model (``LLM``'s keywords) from a checkpoint or config object and the load's
    options (checked when ``cfg`` was made); ``tp``: this rank's tensor-parallel group, or None."""
    from attnzoo.policy import Overrides, resolve
    from attnzoo.policy.profile import profile_from_config, rank_local

    dev = _pick_device(cfg.device) if tp is None else tp.device
    if cfg.piecewise_graph_tokens and dev.type != "cuda":  # before any weights are read
        raise BackendError(f"piecewise CUDA graphs need a CUDA device, the model goes to {dev}",
                           fix="leave piecewise_graph_tokens at 0 off CUDA")
    dt = _pick_dtype(cfg.dtype, dev)
    progress = cfg.progress if tp is None or tp.leader else False  # rank 0 speaks for the group
    say = say_line if (progress if progress is not None else stderr_is_terminal()) else (lambda msg: None)
    if isinstance(name_or_path, PretrainedConfig):
        if cfg.load_format != "random":
            raise ModelLoadError("a config object has no weights", fix="pass load_format='random', or a checkpoint path")
        loader.check_config(name_or_path, "the config object")
        config, src = name_or_path, None
    else:
        src = loader.resolve_source(name_or_path)
        config = loader.load_config(src)
    arch = loader.architecture_of(config)
    cls = model_class(arch, config)  # unknown architectures fail here (Llama-shaped ones load as Llama)
    overrides = Overrides(
        backend=cfg.backend, prefill_backend=cfg.prefill_backend, decode_backend=cfg.decode_backend,
        page_size=cfg.page_size, policy_file=cfg.policy_file, dtype=dt, kv_cache_dtype=cfg.kv_cache_dtype,
    )
    # Tensor parallel: the backends run on one rank's heads, so the policy sees those shapes.
    shapes = config if tp is None else rank_local(profile_from_config(config, architecture=arch), tp.ctx.world_size)
    decision = resolve(shapes, gpu=None if dev.type == "cuda" else "cpu", overrides=overrides, model_id=src.name if src else None)
    log.info("attention policy for %s: %s", arch, decision.explain().splitlines()[0])
    _check_graph_and_cascade(decision, dev, cfg.cuda_graph, cfg.cascade, cfg.prefix_caching)

    weights = plan_weights(config, cls, device=dev, dtype=dt, mode=cfg.fp8_weights,
                           checkpoint_names=loader.checkpoint_tensor_names(src) if cfg.load_format == "auto" else None)

    t0 = time.perf_counter()
    lap, timings = _stopwatch(dev), {}
    say(f"loading {src.name if src else arch} ({arch}, {str(dt).replace('torch.', '')}) on {dev} ...")

    # Seeded random init (load_format="random") without touching the caller's global RNG state.
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        with torch.device(dev), _default_dtype(dt):  # build in place: no float32 copy of a large model
            model = weights.build(cls if tp is None else functools.partial(cls, tp=tp.ctx), config)
    timings["build_s"] = lap()
    if cfg.load_format == "auto":
        model.load_weights(weights.tensors(model, loader.iter_weights(src, config)))
    else:
        model.after_weights_loaded()
    weights.finish(model)
    decision.weights = weights.describe()
    model.eval()
    tokenizer = loader.load_tokenizer(src) if src else None
    timings["weights_s"] = lap()
    say(f"loaded in {time.perf_counter() - t0:.1f} s (model built in {timings['build_s']:.1f} s)")

    text_config = getattr(config, "text_config", None) or config
    context_len = int(getattr(text_config, "max_position_embeddings", 4096))
    if cfg.max_model_len is not None:
        if cfg.max_model_len > context_len:
            raise ModelLoadError(f"max_model_len={cfg.max_model_len} exceeds the model's context ({context_len} tokens)",
                                 fix=f"pass max_model_len <= {context_len}, or leave it unset")
        context_len = cfg.max_model_len
    kv_cache_memory, utilization = cfg.kv_cache_memory, cfg.gpu_memory_utilization
    if utilization is not None and dev.type == "cuda" and cfg.kv_cache_tokens is None and kv_cache_memory is None:
        free, total = torch.cuda.mem_get_info(dev)
        kv_cache_memory = int(utilization * total) - (total - free)
        if kv_cache_memory <= 0:
            raise ModelLoadError(f"gpu_memory_utilization={utilization} leaves no memory for the KV cache "
                                 f"({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use after the weights)",
                                 fix="raise gpu_memory_utilization, or pass kv_cache_tokens")
    specs = model.kv_cache_specs()
    ps = decision.page_size
    kv_dt = kv_storage_dtype(cfg.kv_cache_dtype, dt)
    decision.kv_bytes_per_token = KVPool.bytes_per_token(specs, ps, kv_dt)
    max_batch_tokens = cfg.max_batch_tokens if cfg.max_batch_tokens is not None else (8192 if dev.type == "cuda" else 2048)
    max_running = cfg.max_running
    sized_by_default = kv_cache_memory is None and cfg.kv_cache_tokens is None
    if sized_by_default and dev.type == "cuda" and tp is None:
        kv_cache_memory = _profiled_kv_bytes(model, specs, ps, kv_dt, dt, dev, cfg, decision, context_len,
                                             max_batch_tokens, int(text_config.hidden_size), say)
    copy = HybridBackend.copy_bytes_per_token(decision.prefill_backend, decision.decode_backend, specs, dt, dev)
    num_pages, num_window_pages = _kv_pages(specs, ps, kv_dt, dev, cfg.kv_cache_tokens, kv_cache_memory, context_len,
                                            cfg.window_kv_fraction, max_running, max_batch_tokens, copy)
    if tp is not None:  # rank 0 hands out the same page ids on every rank
        num_pages = tp.min_int(num_pages)
        if num_window_pages is not None:
            num_window_pages = tp.min_int(num_window_pages)
    if max_running is None and num_window_pages is not None and cfg.window_kv_fraction == "auto":
        # the decoding requests whose windows the window group holds (the scheduler's default bounds besides)
        max_running = max(1, min(MAX_RUNNING_CAP, max_batch_tokens, num_pages - 1,
                                 (num_window_pages - 1) // _decode_window_pages(specs, ps)))
    pool = KVPool(specs, num_pages=num_pages, page_size=ps, dtype=dt, device=dev, kv_cache_dtype=cfg.kv_cache_dtype,
                  k_scale=cfg.k_scale, v_scale=cfg.v_scale, num_window_pages=num_window_pages)
    window_note = "" if num_window_pages is None else f" + {num_window_pages} pages of the sliding-window layers"
    copy_bytes = copy * num_pages * ps
    copy_note = "" if not copy else f" + {copy_bytes / 2**30:.2f} GiB of the backend's own copy"
    say(f"allocating the KV cache: {num_pages} pages of {ps} tokens{window_note} "
        f"({pool.nbytes / 2**30:.2f} GiB, {cfg.kv_cache_dtype}){copy_note} ...")
    backends = HybridBackend.create(decision.prefill_backend, decision.decode_backend, pool)
    generation_config = read_generation_config(src.directory if src else None, config)
    eos = _eos_ids(config, tokenizer) | generation_eos_ids(generation_config)
    engine = Engine(
        model, pool, backends, tokenizer=tokenizer, eos_token_ids=eos, context_len=context_len,
        max_batch_tokens=max_batch_tokens, max_running=max_running,
        prefix_caching=cfg.prefix_caching, cascade=cfg.cascade,
    )
    timings["kv_cache_s"] = lap()
    cuda_graph = cfg.cuda_graph if cfg.cuda_graph is not None else dev.type == "cuda" and backends.supports_cuda_graph
    if cuda_graph:
        say("capturing CUDA graphs for decode ...")
        try:
            engine.enable_cuda_graphs(max_batch=engine.max_running, max_context=min(context_len, cfg.cuda_graph_max_context),
                                      batch_sizes=None if cfg.cuda_graph_batch_sizes is None else list(cfg.cuda_graph_batch_sizes),
                                      prune=tp is None and cfg.cuda_graph_batch_sizes is None)
        except torch.OutOfMemoryError as e:
            raise _capture_oom(pool, engine.max_running, sized_by_default=sized_by_default,
                               copy_bytes=copy_bytes) from e
        timings["cuda_graphs_s"] = lap()
    if cfg.piecewise_graph_tokens:
        say("capturing piecewise CUDA graphs ...")
        try:
            engine.runner.enable_piecewise_graphs(min(cfg.piecewise_graph_tokens, engine.max_batch_tokens))
        except torch.OutOfMemoryError as e:
            raise ModelLoadError(
                f"out of GPU memory capturing the piecewise CUDA graphs (steps up to {cfg.piecewise_graph_tokens} "
                f"tokens) beside a KV cache of {pool.nbytes / 2**30:.2f} GiB",
                fix="pass a smaller piecewise_graph_tokens, or leave more room beside the KV cache "
                    "(gpu_memory_utilization=0.8, or a smaller kv_cache_memory)") from e
        timings["piecewise_graphs_s"] = lap()
    if src is None:
        src = loader.CheckpointSource(f"random-weight {arch}", None)
    say(f"ready in {time.perf_counter() - t0:.1f} s (prefill {decision.prefill_backend}, decode {decision.decode_backend})")
    engine.tp = tp
    return dict(model=model, tokenizer=tokenizer, config=config, architecture=arch, source=src, decision=decision,
                pool=pool, engine=engine, dtype=dt, device=dev, progress=say is say_line, tp=tp, load_timings=timings,
                window_kv_fraction=cfg.window_kv_fraction, generation_config=generation_config)


def _check_graph_and_cascade(decision, dev, cuda_graph, cascade, prefix_caching) -> None:
    """Refuse explicit cuda_graph / cascade requests that cannot run, before any weights are read."""
    dec = get_backend_class(decision.decode_backend)
    if cuda_graph and (dev.type != "cuda" or not dec.supports_cuda_graph):
        why = f"the device is {dev}" if dev.type != "cuda" else f"the decode backend {decision.decode_backend!r} has no graph path"
        raise BackendError(f"CUDA graphs were asked for, but {why}",
                           fix="pass cuda_graph=False (or None: automatic), or a decode backend that supports graphs on a GPU")
    check_cascade(dec, prefix_caching, cascade)


def _stopwatch(dev: torch.device) -> Callable[[], float]:
    """-> a function giving the seconds since its last call (or since now), once the device's queued work
    is done: a GPU builds and fills weights asynchronously, and the time belongs to the phase that queued it."""
    last = [time.perf_counter()]

    def lap() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        seconds, last[0] = now - last[0], now
        return round(seconds, 3)

    return lap


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _eos_ids(config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for cfg in (config, getattr(config, "text_config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update(e if isinstance(e, (list, tuple)) else ([e] if e is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
