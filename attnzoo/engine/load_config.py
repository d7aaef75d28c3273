"""``LoadConfig``: every option of ``load_model`` with its default, checked when it is made.

``load_model`` builds one from its keywords (``help(attnzoo.load_model)`` documents each), and the loader
(``engine/build.py``), the tensor- and data-parallel launchers and the spawned ranks read it; being frozen
and plain, it pickles to spawned ranks as it is. Construction raises a ``ModelLoadError`` naming the option
and the fix for any value of the wrong type or range, so a bad argument fails before a process starts or a
weight is read. What needs the machine or the checkpoint (the device, the backends, max_model_len against
the model's context) is checked by the loader, still before the weights.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterator
from dataclasses import dataclass

from attnzoo.errors import ModelLoadError

# Default window_kv_fraction "auto": a window page group sized for the running requests' windows where a layer
# compresses its keys (``kv_cache.wants_window_group``: V4's raw keys and compressor state are 29x its entries per
# token), one group elsewhere: there a split fixed at load lowers few-shot evals' concurrency, as a request shorter
# than the window needs as many window tokens as full ones (results: e2e_gemma4_31b_{onegroup,window05}).
WINDOW_KV_FRACTION = "auto"


@dataclass(frozen=True)
class LoadConfig:
    # Attention backends and the policy: None lets the policy table choose (attnzoo/policy/).
    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    page_size: int | None = None
    policy_file: str | None = None

    # Where and in what precision: dtype None/"auto" is bf16 on a GPU, fp32 on the CPU; device None is cuda
    # when available; fp8_weights "auto", "fp8" or "dequantize" (FP8 block-quantized checkpoints), or "mxfp4"
    # (an MXFP4 checkpoint's experts kept as stored; "auto" dequantizes them at load).
    dtype: object = None
    device: object = None
    load_format: str = "auto"
    fp8_weights: str = "auto"
    seed: int = 0

    # The KV cache: its size (tokens, bytes, or vLLM's gpu_memory_utilization; None: 85% of the free memory
    # on a GPU, less what a measured step needs beyond the rest), what it stores (kv_cache_dtype with its per-tensor k/v scales) and the sliding-window
    # layers' page group (window_kv_fraction "auto", a fraction in (0, 1], or None: one group).
    kv_cache_tokens: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    window_kv_fraction: float | str | None = WINDOW_KV_FRACTION

    # The engine: its batch limits, vLLM's max_model_len (None: the model's context), shared-prefix reuse,
    # decode CUDA graphs and cascade attention (None: wherever the backend supports them).
    max_batch_tokens: int | None = None
    max_running: int | None = None
    max_model_len: int | None = None
    prefix_caching: bool = True
    cuda_graph: bool | None = None
    cuda_graph_max_context: int = 8192
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    piecewise_graph_tokens: int = 0
    cascade: bool | None = None

    # Processes: tensor-parallel ranks per replica, data-parallel replicas (None: 1, or torchrun's world),
    # and status lines on stderr (None: when stderr is a terminal).
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cuda_graph_batch_sizes, Iterator):  # read once, here
            object.__setattr__(self, "cuda_graph_batch_sizes", list(self.cuda_graph_batch_sizes))
        self.validate()
        if self.cuda_graph_batch_sizes is not None:
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(self.cuda_graph_batch_sizes))

    def validate(self) -> None:
        """Raise a ModelLoadError naming the first option of the wrong type or range, and its fix."""
        if self.load_format not in ("auto", "random"):
            raise ModelLoadError(f"unknown load_format {self.load_format!r}", fix="use 'auto' or 'random'")
        for name in ("max_running", "max_batch_tokens", "kv_cache_tokens", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ModelLoadError(f"{name} must be a positive integer, got {value!r}",
                                     fix=f"pass {name}=N with N >= 1, or leave it unset for the default")
        if not _positive_int(self.cuda_graph_max_context):
            raise ModelLoadError(f"cuda_graph_max_context must be a positive integer, got {self.cuda_graph_max_context!r}",
                                 fix="pass cuda_graph_max_context=N tokens with N >= 1")
        f = self.window_kv_fraction
        if f not in (None, "auto") and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ModelLoadError(f"window_kv_fraction must be \"auto\", a number in (0, 1] or None, got {f!r}",
                                 fix="pass window_kv_fraction=\"auto\" (the default), e.g. 0.5, or None for one KV page group")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            # The scales divide every stored k/v: 0, a negative or NaN would fill the cache with inf/NaN.
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
                raise ModelLoadError(f"{name} must be a positive finite number, got {value!r}",
                                     fix=f"pass {name}=1.0 (values kept as they are) or the checkpoint's calibrated scale")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0 < u <= 1):
            raise ModelLoadError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}",
                                 fix="pass e.g. gpu_memory_utilization=0.9, or leave it unset")
        n = self.max_model_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ModelLoadError(f"max_model_len must be an integer >= 2, got {n!r}",
                                 fix="pass max_model_len=N tokens, or leave it unset for the model's context")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ModelLoadError(f"seed must be an integer in [0, 2**64), got {self.seed!r}", fix="pass seed=0 (any int)")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and (isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__")
                                  or not all(_positive_int(b) for b in sizes)):
            raise ModelLoadError(f"cuda_graph_batch_sizes must be a list of positive integers, got {sizes!r}",
                                 fix="pass e.g. cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64], or None for the default list")
        p = self.piecewise_graph_tokens
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ModelLoadError(f"piecewise_graph_tokens must be an integer >= 0, got {p!r}",
                                 fix="pass e.g. piecewise_graph_tokens=512, or 0 for no piecewise CUDA graphs")
        if p and self.tensor_parallel_size not in (None, 1):
            raise ModelLoadError("piecewise CUDA graphs are not supported under tensor parallelism",
                                 fix="leave piecewise_graph_tokens at 0, or load with tensor_parallel_size=1")
        for name in ("cuda_graph", "cascade", "progress"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ModelLoadError(f"{name} must be True, False or None, got {value!r}", fix=f"pass {name}=True/False")
        tp = self.tensor_parallel_size
        if tp is not None and not _positive_int(tp):
            raise ModelLoadError(f"tensor_parallel_size must be a positive integer, got {tp!r}",
                                 fix="pass tensor_parallel_size=N with N >= 1")
        dp = self.data_parallel_size
        if dp is not None and not _positive_int(dp):
            raise ModelLoadError(f"data_parallel_size must be a positive integer, got {dp!r}",
                                 fix="pass data_parallel_size=N with N >= 1")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1



def either(config: LoadConfig | None, keywords: LoadConfig) -> LoadConfig:
    """``load_model``'s options: ``config`` when given (then every keyword must be left at its default), else
    those of its keywords."""
    if config is None:
        return keywords
    if not isinstance(config, LoadConfig):
        raise ModelLoadError(f"config must be an attnzoo.LoadConfig, got {type(config).__name__}",
                             fix="pass config=attnzoo.LoadConfig(...), or the options as keywords")
    default = LoadConfig()
    given = [f.name for f in dataclasses.fields(keywords) if getattr(keywords, f.name) != getattr(default, f.name)]
    if given:
        raise ModelLoadError(f"load_model got config= and the keyword(s) {', '.join(given)}",
                             fix="pass the options either in the LoadConfig or as keywords, not both "
                                 "(dataclasses.replace(config, ...) changes some)")
    return config
