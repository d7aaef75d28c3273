"""Public API: ``load_model(...) -> LLM`` and the LLM's generate / logits / info."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch
from transformers import PretrainedConfig

from attnzoo.attention.backends import get_backend_class
from attnzoo.attention.kv_cache import KVPool, kv_storage_dtype
from attnzoo.engine.engine import Completion, Engine
from attnzoo.engine.sampling import SamplingParams
from attnzoo.errors import BackendError, ModelLoadError, RequestError
from attnzoo.models import loader
from attnzoo.models.registry import model_class

log = logging.getLogger("attnzoo")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _pick_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA GPU is available", fix="pass device='cpu'")
    return dev


def _pick_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}", fix=f"use one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _kv_pages(specs, page_size, dtype, device, kv_cache_tokens, kv_cache_memory, context_len) -> int:
    per_page = KVPool.bytes_per_page(specs, page_size, dtype)
    if kv_cache_tokens is not None:
        return -(-kv_cache_tokens // page_size) + 1
    if kv_cache_memory is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free * 0.85)
        else:
            # CPU: enough for several full-length sequences without eating the machine's memory.
            kv_cache_memory = min(1 << 30, per_page * (-(-8 * context_len // page_size)))
    return max(2, kv_cache_memory // per_page)


class LLM:
    def __init__(self, *, model, tokenizer, config, architecture, source, decision, pool, engine, dtype, device):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.architecture = architecture
        self.source = source
        self.decision = decision
        self.pool = pool
        self.engine = engine
        self.dtype = dtype
        self.device = device

    # ------------------------------------------------------------------ inputs

    def _encode(self, prompt) -> list[int]:
        if self.tokenizer is None and not (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)):
            raise RequestError(f"{self.source.name} has no tokenizer, so prompts must be token id lists",
                               fix="pass token ids, or a checkpoint with tokenizer files")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt string", fix="pass non-empty text")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RequestError("chat messages given but the tokenizer has no chat template", fix="pass a plain string")
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = self.config_vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", fix="pass valid token ids")
            return ids
        raise RequestError(
            f"cannot read a prompt of type {type(prompt).__name__}",
            fix="pass a string, a list of chat messages ({'role':..., 'content':...}), or a list of token ids",
        )

    @property
    def config_vocab_size(self) -> int:
        return (getattr(self.config, "text_config", None) or self.config).vocab_size

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        return_logits: bool = False,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """One Completion per prompt, in input order. A single prompt may be passed bare.
        ``on_finish(i)`` is called when prompt i finishes (progress bars)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and (isinstance(prompts[0], (int, dict)))
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestError("no prompts given", fix="pass at least one prompt")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        ids = [self._encode(p) for p in batch]
        params = [
            SamplingParams(max_new_tokens, temperature, top_p, top_k, None if seed is None else seed + i, stops, ignore_eos)
            for i in range(len(batch))
        ]
        return self.engine.generate(ids, params, return_logits=return_logits, on_finish=on_finish)

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] float32 (on CPU)."""
        ids = self._encode(list(token_ids))
        return self.engine.score(ids).cpu()

    def _cascade_info(self) -> str:
        e = self.engine
        if e.cascade:
            return (f"on: decode steps whose requests share >= 1 page read it once "
                    f"(when shared tokens x (requests - 1) >= {e.cascade_min_saved_tokens}; such steps run eagerly)")
        if e.prefix_cache is None:
            return "off: prefix caching is off"
        if not e.decode_backend.supports_cascade:
            return f"off: decode backend {e.decode_backend.name!r} has no cascade path"
        return "off: turned off (cascade=False)"

    def info(self) -> dict[str, Any]:
        specs = self.model.kv_cache_specs()
        elt = torch.empty((), dtype=self.pool.kv_dtype).element_size()
        kv_bytes_per_token = KVPool.bytes_per_page(specs, 1, self.pool.kv_dtype)
        return {
            "model": self.source.name,
            "architecture": self.architecture,
            "prefill_backend": self.decision.prefill_backend,
            "decode_backend": self.decision.decode_backend,
            "page_size": self.pool.page_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": str(self.pool.kv_dtype).replace("torch.", ""),
            "kv_cache_dtype": self.pool.kv_cache_dtype,
            "kv_scales": {"k_scale": self.pool.k_scale, "v_scale": self.pool.v_scale},
            "device": str(self.device),
            "kv_cache_pages": self.engine.allocator.capacity,
            "kv_cache_tokens": self.engine.allocator.capacity * self.pool.page_size,
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_layers_with_memory": sum(1 for i in range(len(specs)) if self.pool.owns_memory(i)),
            "kv_element_bytes": elt,
            "context_len": self.engine.context_len,
            "cuda_graph": None if self.engine.graphs is None else {
                "batch_buckets": self.engine.graphs.buckets, "max_context": self.engine.graphs.max_context},
            "cascade": self._cascade_info(),
            "decision": self.decision.to_dict(),
        }


def load_model(
    name_or_path=None,
    *,
    backend: str | None = None,
    prefill_backend: str | None = None,
    decode_backend: str | None = None,
    dtype=None,
    device=None,
    page_size: int | None = None,
    policy_file: str | None = None,
    kv_cache_tokens: int | None = None,
    kv_cache_memory: int | None = None,
    max_batch_tokens: int | None = None,
    max_running: int = 256,
    prefix_caching: bool = True,
    cuda_graph: bool | None = None,
    cuda_graph_max_context: int = 8192,
    cascade: bool | None = None,
    load_format: str = "auto",
    seed: int = 0,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> LLM:
    """Load a checkpoint (local dir, hub id, .gguf file; None = embedded SmolLM2-135M-Instruct).

    ``load_format="random"`` builds the model from its config with random weights (for benchmarks of
    full-size shapes without the weights); the tokenizer is still loaded when the checkpoint has one.
    ``cascade``: read a prefix shared by a whole decode batch once per step (None: wherever the decode
    backend supports it and prefix caching is on; ``info()["cascade"]`` says which).
    ``kv_cache_dtype``: "auto" (the model dtype) or "fp8_e4m3" (MHA/GQA models: half the bytes of bf16,
    so twice the KV capacity in the same memory); the pool stores k / k_scale and v / v_scale. The
    scales are per tensor and default to 1.0, as vLLM's default (calculate_kv_scales=False): no
    calibration, values beyond +-448 saturate.
    """
    from attnzoo.defaults import Overrides, resolve

    if load_format not in ("auto", "random"):
        raise ModelLoadError(f"unknown load_format {load_format!r}", fix="use 'auto' or 'random'")
    for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens),
                        ("kv_cache_tokens", kv_cache_tokens), ("kv_cache_memory", kv_cache_memory)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ModelLoadError(f"{name} must be a positive integer, got {value!r}",
                                 fix=f"pass {name}=N with N >= 1, or leave it unset for the default")
    dev = _pick_device(device)
    dt = _pick_dtype(dtype, dev)
    if isinstance(name_or_path, PretrainedConfig):
        if load_format != "random":
            raise ModelLoadError("a config object has no weights", fix="pass load_format='random', or a checkpoint path")
        config, src = name_or_path, None
    else:
        src = loader.resolve_source(name_or_path)
        config = loader.load_config(src)
    arch = loader.architecture_of(config)
    cls = model_class(arch)  # unknown architectures fail here, before any weights are read
    overrides = Overrides(
        backend=backend, prefill_backend=prefill_backend, decode_backend=decode_backend,
        page_size=page_size, policy_file=policy_file, dtype=dt, kv_cache_dtype=kv_cache_dtype,
    )
    decision = resolve(config, gpu=None if dev.type == "cuda" else "cpu", overrides=overrides, model_id=src.name if src else None)
    log.info("attention policy for %s: %s", arch, decision.explain().splitlines()[0])

    # Seeded random init (load_format="random") without touching the caller's global RNG state.
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(dev), _default_dtype(dt):  # build in place: no float32 copy of a large model
            model = cls(config)
    if load_format == "auto":
        model.load_weights(loader.iter_weights(src, config))
    else:
        model.after_weights_loaded()
    model.eval()
    tokenizer = loader.load_tokenizer(src) if src else None

    text_config = getattr(config, "text_config", None) or config
    context_len = int(getattr(text_config, "max_position_embeddings", 4096))
    specs = model.kv_cache_specs()
    ps = decision.page_size
    kv_dt = kv_storage_dtype(kv_cache_dtype, dt)
    decision.kv_bytes_per_token = KVPool.bytes_per_page(specs, 1, kv_dt)
    num_pages = _kv_pages(specs, ps, kv_dt, dev, kv_cache_tokens, kv_cache_memory, context_len)
    pool = KVPool(specs, num_pages=num_pages, page_size=ps, dtype=dt, device=dev, kv_cache_dtype=kv_cache_dtype,
                  k_scale=k_scale, v_scale=v_scale)
    pre = get_backend_class(decision.prefill_backend)(pool)
    dec = pre if decision.decode_backend == decision.prefill_backend else get_backend_class(decision.decode_backend)(pool)
    eos = _eos_ids(config, tokenizer)
    engine = Engine(
        model, pool, pre, dec, tokenizer=tokenizer, eos_token_ids=eos, context_len=context_len,
        max_batch_tokens=max_batch_tokens if max_batch_tokens is not None else (8192 if dev.type == "cuda" else 2048), max_running=max_running,
        prefix_caching=prefix_caching, cascade=cascade,
    )
    if cuda_graph is None:
        cuda_graph = dev.type == "cuda" and dec.supports_cuda_graph
    if cuda_graph:
        if dev.type != "cuda" or not dec.supports_cuda_graph:
            raise BackendError(
                f"CUDA graphs were asked for, but the decode backend {dec.name!r} on {dev} does not support them",
                fix="pass cuda_graph=False, or a decode backend that supports graphs on a GPU",
            )
        engine.enable_cuda_graphs(max_batch=max_running, max_context=min(context_len, cuda_graph_max_context))
    if src is None:
        src = loader.CheckpointSource(f"random-weight {arch}", None)
    return LLM(model=model, tokenizer=tokenizer, config=config, architecture=arch, source=src, decision=decision,
               pool=pool, engine=engine, dtype=dt, device=dev)


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
