"""Public API: ``load_model(...) -> LLM`` and the LLM's generate / logits / info."""
from __future__ import annotations

import functools
import logging
import numbers
import threading
from typing import Any, Callable, Sequence

import torch

from attnzoo.attention.kv_cache import KVPool, kv_bytes_by_kind, kv_footprint
from attnzoo.engine import build, describe, load_config
from attnzoo.engine.engine import Completion
from attnzoo.engine.load_config import WINDOW_KV_FRACTION, LoadConfig
from attnzoo.engine.progress import GenerationProgress
from attnzoo.engine.prompts import chat_message, valid_text
from attnzoo.engine.sampling import SamplingParams
from attnzoo.errors import RequestError

log = logging.getLogger("attnzoo")

def _tensor_parallel_call(method):
    """Tensor parallel: rank 0 runs the call and the other ranks follow it (attnzoo.engine.tensor_parallel)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.tp is None:
            return method(self, *args, **kwargs)
        # The whole call, the closing message to the other ranks included, under the one lock: two
        # threads' messages must not interleave on the control group.
        with self._lock:
            return self.tp.call(lambda: method(self, *args, **kwargs))

    return call


class LLM:
    """A loaded model. ``LLM(model=path_or_hub_id, **kwargs)`` loads one as vLLM's ``LLM`` does (load_model's
    keywords, or vLLM's engine arguments: ``attnzoo.engine.compat``); ``load_model(...)`` is the same."""

    def __new__(cls, model=None, **kwargs):
        if "engine" in kwargs:  # load_model's own construction
            return super().__new__(cls)
        from attnzoo.engine.compat import load_kwargs

        return load_model(**load_kwargs(model, kwargs, load_model))

    def __init__(self, model=None, **kwargs):
        if "engine" in kwargs:  # else __new__ returned a loaded LLM
            self._setup(model=model, **kwargs)

    def _setup(self, *, model, tokenizer, config, architecture, source, decision, pool, engine, dtype, device,
               progress: bool = False, tp=None, load_timings: dict | None = None,
               window_kv_fraction: float | str | None = None, generation_config=None):
        self.generation_config = generation_config  # transformers.GenerationConfig: the checkpoint's defaults
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
        self.tp = tp  # TPGroup when tensor parallel, else None
        self.load_timings = dict(load_timings or {})  # seconds per load_model phase (this rank's)
        self.progress = progress  # status lines on stderr (generate's progress when no on_finish is given)
        self.window_kv_fraction = window_kv_fraction  # as load_model was given it
        # One engine runs one batch at a time: concurrent calls would over-commit its KV reservations.
        self._lock = threading.RLock()  # re-entered by a tensor-parallel call (_tensor_parallel_call)

    # ------------------------------------------------------------------ inputs

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, (list, tuple)) and prompt and set(map(type, prompt)) == {int}:
            # Plain token ids, the usual case, checked by C loops: per-token Python checks would cost
            # seconds of an eval's wall before the GPU starts.
            if min(prompt) < 0 or max(prompt) >= self.config_vocab_size:
                bad = next(t for t in prompt if not 0 <= t < self.config_vocab_size)
                raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.config_vocab_size - 1})",
                                   fix="pass valid token ids")
            return list(prompt)
        if isinstance(prompt, (list, tuple)) and any(isinstance(t, bool) for t in prompt):
            raise RequestError(f"a prompt holds {next(t for t in prompt if isinstance(t, bool))!r} where a token id "
                               "belongs", fix="pass token ids as plain integers")
        if self.tokenizer is None and not (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)):
            raise RequestError(f"{self.source.name} has no tokenizer, so prompts must be token id lists",
                               fix="pass token ids, or a checkpoint with tokenizer files")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt string", fix="pass non-empty text")
            return self.tokenizer.encode(valid_text(prompt, "the prompt"), add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RequestError("chat messages given but the tokenizer has no chat template", fix="pass a plain string")
            messages = [chat_message(j, m) for j, m in enumerate(prompt)]
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # jinja2's TemplateError family, or whatever the template's own code raises
                raise RequestError(f"the tokenizer's chat template failed on these messages ({type(e).__name__}: {e})",
                                   fix="check the messages against what the template expects (roles, their order), "
                                   "repair chat_template in tokenizer_config.json, or pass a plain string") from None
            return self.tokenizer.encode(valid_text(text, "the chat template's output"), add_special_tokens=False)
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

    @_tensor_parallel_call
    def generate(
        self,
        prompts,
        sampling_params=None,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        return_logits: bool = False,
        on_finish: Callable[[int], None] | None = None,
        do_sample: bool | None = None,
        min_new_tokens: int = 0,
        repetition_penalty: float = 1.0,
        stop_strings: str | Sequence[str] | None = None,
        max_length: int | None = None,
        num_return_sequences: int = 1,
        generation_config=None,
        **unsupported,
    ) -> list[Completion]:
        """One Completion per prompt (``num_return_sequences`` per prompt, grouped by prompt), in input order.

        A single prompt may be passed bare. ``max_new_tokens`` defaults to 256; ``max_length`` instead
        caps prompt + new tokens per prompt (as in transformers; give one of the two). ``temperature``
        0 is greedy; ``do_sample=False`` forces greedy, ``do_sample=True`` samples (temperature 1.0
        unless given). ``stop_strings`` is another name for ``stop``. ``min_new_tokens`` masks EOS until
        that many tokens are out; ``repetition_penalty`` follows transformers (prompt and output tokens).

        Seeds: an int ``seed`` gives output ``i`` (its position in the returned list) the seed
        ``seed + i``; a list gives one seed per returned sequence. A seeded request's tokens do not
        depend on what else is in the batch. ``on_finish(i)`` is called when output ``i`` finishes.
        Safe to call from several threads: calls run one at a time.

        vLLM's spelling: ``generate(prompts, attnzoo.SamplingParams(...))`` returns one ``RequestOutput`` per
        prompt instead. transformers': ``generation_config=GenerationConfig(...)`` with these keywords over it
        (``attnzoo.engine.compat``).
        """
        if sampling_params is not None or generation_config is not None:
            from attnzoo.engine import compat

            given = compat.given_keywords(LLM.generate, locals())
            if sampling_params is not None:
                use_tqdm = given.pop("use_tqdm", None)
                if given or generation_config is not None:
                    raise RequestError(f"generate() got sampling_params and also {', '.join(sorted(given) or ['generation_config'])}",
                                       fix="put every sampling choice in the SamplingParams")
                return compat.run_requests(self, prompts, sampling_params, use_tqdm=use_tqdm, progress=GenerationProgress)
            return LLM.generate.__wrapped__(self, prompts, **compat.generation_kwargs(self, generation_config, given))
        if unsupported:
            raise RequestError(
                f"generate() does not support {', '.join(sorted(unsupported))}",
                fix="use max_new_tokens / max_length, temperature / do_sample, top_p, top_k, seed, stop / stop_strings, "
                "min_new_tokens, repetition_penalty, num_return_sequences, ignore_eos, return_logits",
            )
        if prompts is None or not isinstance(prompts, (str, list, tuple)):
            raise RequestError(f"prompts must be a string, a token id list, chat messages or a list of those, "
                               f"got {type(prompts).__name__}", fix="pass e.g. generate('Hello') or generate(['a', 'b'])")
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and (isinstance(prompts[0], (int, dict)))
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestError("no prompts given", fix="pass at least one prompt")
        if stop is not None and stop_strings is not None:
            raise RequestError("both stop and stop_strings were given", fix="pass one of them (they mean the same)")
        stop = stop if stop is not None else stop_strings
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", fix="pass stop='text' or stop=['a', 'b']")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops and self.tokenizer is None:
            raise RequestError(f"stop strings need a tokenizer to read the output, and {self.source.name} has none",
                               fix="drop stop=, or load a checkpoint with tokenizer files")
        n = num_return_sequences
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise RequestError(f"num_return_sequences must be an integer >= 1, got {n!r}", fix="pass num_return_sequences=N")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise RequestError(f"do_sample must be True or False, got {do_sample!r}", fix="pass a bool")
        if do_sample is False:
            temperature = 0.0
        elif do_sample and isinstance(temperature, numbers.Real) and temperature == 0:
            temperature = 1.0  # transformers' default when sampling
        if n > 1 and isinstance(temperature, numbers.Real) and temperature == 0:
            raise RequestError(f"num_return_sequences={n} with greedy decoding returns {n} identical sequences",
                               fix="sample (do_sample=True or temperature > 0), or pass num_return_sequences=1")
        if max_new_tokens is not None and max_length is not None:
            raise RequestError("both max_new_tokens and max_length were given",
                               fix="pass max_new_tokens (new tokens) or max_length (prompt + new tokens), not both")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral)):
            raise RequestError(f"max_length must be an integer, got {max_length!r}", fix="pass max_length=N")
        ids = [self._encode(p) for p in batch]
        ids = [p for p in ids for _ in range(n)]
        seeds = self._seeds(seed, len(ids))
        limits = []
        for i, p in enumerate(ids):
            if max_length is None:
                limits.append(256 if max_new_tokens is None else max_new_tokens)
            elif max_length <= len(p):
                raise RequestError(f"max_length={max_length} leaves no room after prompt {i // n} of {len(p)} tokens",
                                   fix="raise max_length above the prompt length, or pass max_new_tokens")
            else:
                limits.append(max_length - len(p))
        params = [
            SamplingParams(limit, temperature, top_p, top_k, s, stops, ignore_eos, min_new_tokens, repetition_penalty)
            for limit, s in zip(limits, seeds)
        ]
        for sp in params:
            sp.validate()
        show = self.progress and on_finish is None
        if show:
            on_finish = GenerationProgress(len(ids))
        with self._lock:
            outs = self.engine.generate(ids, params, return_logits=return_logits, on_finish=on_finish)
        if show:
            on_finish.close(outs)
        return outs

    @_tensor_parallel_call
    def chat(self, messages, sampling_params=None, *, use_tqdm: bool | None = None):
        """vLLM's chat: a conversation ({'role', 'content'} dicts) or a list of them, through the tokenizer's
        chat template; one RequestOutput per conversation (``sampling_params`` None: the checkpoint's defaults)."""
        from attnzoo.engine.compat import run_requests

        return run_requests(self, messages, sampling_params, use_tqdm=use_tqdm, chat=True, progress=GenerationProgress)

    def get_default_sampling_params(self):
        """vLLM's: the checkpoint's generation_config.json sampling defaults as attnzoo.SamplingParams."""
        from attnzoo.engine.compat import default_sampling_params

        return default_sampling_params(self)

    def get_tokenizer(self):
        return self.tokenizer

    @staticmethod
    def _seeds(seed, count: int) -> list:
        if seed is None:
            return [None] * count
        if isinstance(seed, (list, tuple)):
            if len(seed) != count:
                raise RequestError(f"seed lists {len(seed)} seeds for {count} outputs",
                                   fix="pass one seed per returned sequence (prompts x num_return_sequences), or one int")
            return list(seed)  # each checked by SamplingParams.validate
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0 or seed + count > 2**64:
            raise RequestError(f"seed must be an integer in [0, 2**64 - {count}] (output i uses seed + i), got {seed!r}",
                               fix="pass an int such as seed=0, a list of ints, or None for random seeds")
        return [int(seed) + i for i in range(count)]

    @_tensor_parallel_call
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] float32 (on CPU)."""
        ids = self._encode(list(token_ids))
        with self._lock:
            return self.engine.score(ids).cpu()

    def info(self) -> dict[str, Any]:
        specs = self.model.kv_cache_specs()
        elt = torch.empty((), dtype=self.pool.kv_dtype).element_size()
        kv_bytes_per_token = KVPool.bytes_per_token(specs, self.pool.page_size, self.pool.kv_dtype)
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
            "kv_page_groups": describe.page_groups(self.pool, self.engine, specs, self.window_kv_fraction),
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_bytes_per_token_by_kind": kv_bytes_by_kind(specs, self.pool.page_size, self.pool.kv_dtype),
            "kv_footprint": kv_footprint(self.pool, self.config),
            "kv_layers_with_memory": sum(1 for i in range(len(specs)) if self.pool.owns_memory(i)),
            "kv_element_bytes": elt,
            "context_len": self.engine.context_len,
            "max_running": self.engine.max_running,
            "cuda_graph": None if (g := self.engine.graphs) is None else {
                # dropped sizes -> the faster size they pad to; graphs captured since: (rows, cascade key or None)
                "batch_buckets": g.buckets, "max_context": g.max_context, "pruned_buckets": dict(g.pruned),
                "exact_from": g.exact_from, "captured_while_generating": [list(k) for k in g.on_demand],
                "captured_while_generating_bytes": [g.on_demand_bytes, g.max_on_demand_bytes]},  # [held, cap]
            # steps replayed as pieces between eager attention calls: their token buckets (None: off)
            "piecewise_graphs": None if (p := self.engine.runner.pieces) is None else {
                "buckets": p.buckets, "graphs": p.num_graphs, "capture_s": round(p.capture_s, 2),
                # the buckets' mixed steps captured whole, attention inside: [most chunks a step, or None; why]
                "whole_steps": describe.whole_steps(self.engine.runner)},
            "cascade": describe.cascade_state(self.engine),
            # a short prompt chunk after a cached prefix replayed as decode rows: [most new tokens, why]
            "token_rows": list(self.engine.runner.token_rows_limit()),
            # a mixed step's leading decode rows on the decode backend from this many on: [rows or None, why]
            "mixed_steps": list(self.engine.runner.backends.mixed_split()),
            # > 1: kv_bytes_per_token and the KV capacity are per rank (each holds its own heads)
            "tensor_parallel_size": 1 if self.tp is None else self.tp.ctx.world_size,
            "weights": dict(self.decision.weights),
            # build_s (model construction; random weights drawn), weights_s (checkpoint read, GEMMs chosen),
            # kv_cache_s (rank 0: waits for the slowest rank too), cuda_graphs_s (capture, decode kernels' JIT)
            "load_timings": dict(self.load_timings),
            "decision": self.decision.to_dict(),
        }

    @_tensor_parallel_call
    def warm_up(self) -> dict:
        """Compile and load what the first requests would otherwise wait for (``Engine.warm_up``); ``attnzoo
        serve`` calls it before it answers /health."""
        vocab = self.config_vocab_size
        with self._lock:
            return self.engine.warm_up((min(10, vocab - 1), min(11, vocab - 1)))

    def close(self) -> None:
        """Tensor parallel from one process: stop the ranks this model spawned (also done at exit); later
        calls raise DistributedError."""
        if self.tp is not None:
            self.tp.close()


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
    max_running: int | None = None,
    prefix_caching: bool = True,
    cuda_graph: bool | None = None,
    cuda_graph_max_context: int = 8192,
    cuda_graph_batch_sizes: list[int] | None = None,
    piecewise_graph_tokens: int = 0,
    cascade: bool | None = None,
    load_format: str = "auto",
    fp8_weights: str = "auto",
    seed: int = 0,
    tensor_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    progress: bool | None = None,
    window_kv_fraction: float | str | None = WINDOW_KV_FRACTION,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    config: LoadConfig | None = None,
) -> LLM:
    """Load a checkpoint (local dir, hub id, .gguf file; None = embedded SmolLM2-135M-Instruct).

    ``load_format="random"`` builds the model from its config with random weights (for benchmarks of
    full-size shapes without the weights); the tokenizer is still loaded when the checkpoint has one.
    ``max_running``: the most requests decoding at once (None: as many as the KV pages and the token
    budget allow, at most 4096; ``info()["max_running"]`` says how many).
    ``cuda_graph_batch_sizes``: the decode batch sizes captured as CUDA graphs (None:
    ``cuda_graph.DEFAULT_BUCKETS``, at most 12.5% padding from 64 on, less the sizes whose GEMMs measured
    slower than the next size's, ``cuda_graph.prune_buckets``; a list given is taken as it is); a step
    runs at the smallest size that holds it (``max_running`` always one), or above 256 rows at its own (to 8)
    once it kept it 3 steps, within a cap on those graphs' count and bytes (``info()["cuda_graph"]``).
    ``piecewise_graph_tokens=N``: steps of up to N tokens the decode graphs do not serve replay CUDA graphs
    between their eager attention calls (``engine.piecewise``: CUDA, one GPU, no NSA or compressed layers); where
    both backends capture mixed steps whole (triton), those steps replay one graph each, attention inside
    (``engine.mixed_graphs``; ``info()["piecewise_graphs"]["whole_steps"]`` says whether).
    ``cascade``: read a prefix shared by a whole decode batch once per step (None: wherever the decode
    backend supports it and prefix caching is on; ``info()["cascade"]`` says which).
    ``tensor_parallel_size=N``: split the model over N GPUs (N CPU processes on CPU): this process is
    rank 0 and starts the others. Under torchrun, every rank calls load_model (N defaults to WORLD_SIZE)
    and the other ranks' generate/logits follow rank 0's (``attnzoo.engine.tensor_parallel``).
    ``data_parallel_size=N``: N replicas (each ``tensor_parallel_size`` ranks); returns a
    ``DataParallelLLM`` whose ``generate`` spreads the prompts over them (``attnzoo.engine.data_parallel``;
    under torchrun, ranks other than 0 serve inside this call and return None).
    ``kv_cache_dtype``: "auto" (the model dtype) or "fp8_e4m3" (MHA/GQA models: half the bytes of bf16,
    so twice the KV capacity in the same memory); the pool stores k / k_scale and v / v_scale. The
    scales are per tensor and default to 1.0, as vLLM's default (calculate_kv_scales=False): no
    calibration, values beyond +-448 saturate.
    ``fp8_weights`` (FP8 block-quantized checkpoints): "auto" keeps the stored FP8 layers and runs FP8
    GEMMs on GPUs with FP8 tensor cores, and dequantizes to ``dtype`` at load elsewhere (CPU: the reference
    path); "fp8" insists on FP8 layers (on CPU they run a float32 emulation); "dequantize" always
    dequantizes. ``info()["weights"]`` states the format and the GEMM path. Under tensor parallelism a
    split layer stays FP8 where each rank's part is whole 128-blocks (else it is dequantized, and
    ``info()["weights"]["split_blocks"]`` says why); the routed experts (whole experts per rank) stay FP8.
    MXFP4 checkpoints (gpt-oss): "auto" / "dequantize" dequantize the experts to ``dtype`` at load; "mxfp4"
    keeps them as stored, read by the fused MoE's MXFP4 GEMM (w4a16) on a GPU.
    ``progress``: status lines on stderr (loading, KV allocation, generation); None: when stderr is a terminal.
    ``window_kv_fraction``: models with sliding-window layers (Gemma 4, DeepSeek-V4) whose context is longer
    than the window can get two KV page groups in the one pool: the sliding layers keep only the pages their
    window still sees (released as it moves on), the others every token. A float in (0, 1] sizes the window
    group in tokens per full-group token (``kv_cache_tokens`` counts the full group; memory is split
    accordingly); None: one group, every layer keeps every token; "auto" (the default, ``WINDOW_KV_FRACTION``
    says why): two groups where a layer compresses its keys (V4), the window group sized for ``max_running``
    decoding requests' windows plus one prefill chunk, else one group. ``info()["kv_page_groups"]`` reports
    both capacities and the split, ``info()["kv_footprint"]`` the measured bytes per token.
    ``gpu_memory_utilization`` (vLLM's): the fraction of the GPU's memory this process may hold once the
    KV cache is allocated (weights + KV; None: the KV cache takes 85% of what is free after the weights, less
    what one measured step of ``max_batch_tokens`` tokens needs beyond the rest: ``engine/memory.py``);
    ignored on CPU, where the KV cache is sized by ``kv_cache_tokens`` / ``kv_cache_memory``.
    ``max_model_len`` (vLLM's): the longest prompt + output, at most the model's ``max_position_embeddings``.
    ``config``: every option above as one ``attnzoo.LoadConfig`` (then pass none of them as keywords).
    Every argument, the device and the backend choices are checked before any weights are read.
    """
    cfg = load_config.either(config, LoadConfig(
        backend=backend, prefill_backend=prefill_backend, decode_backend=decode_backend, page_size=page_size,
        policy_file=policy_file, dtype=dtype, device=device, load_format=load_format, fp8_weights=fp8_weights,
        seed=seed, kv_cache_tokens=kv_cache_tokens, kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
        v_scale=v_scale, window_kv_fraction=window_kv_fraction, max_batch_tokens=max_batch_tokens,
        max_running=max_running, max_model_len=max_model_len, prefix_caching=prefix_caching, cuda_graph=cuda_graph,
        cuda_graph_max_context=cuda_graph_max_context, cuda_graph_batch_sizes=cuda_graph_batch_sizes,
        piecewise_graph_tokens=piecewise_graph_tokens, cascade=cascade, tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        progress=progress,
    ))
    from attnzoo.engine import data_parallel

    if (cfg.data_parallel_size or 1) > 1:
        return data_parallel.launch(name_or_path, cfg, _load_replica)
    return _load_replica(name_or_path, cfg)


def _load_replica(name_or_path, cfg: LoadConfig) -> LLM:
    """One replica of the model: this process alone, or the tensor-parallel group it leads or joins."""
    from attnzoo.engine import launch, tensor_parallel

    group = launch.launch(name_or_path, cfg, _load_replica)
    try:
        with launch.loading(group):
            llm = LLM(**build.build(name_or_path, cfg, tp=group))
    except BaseException:
        if group is not None:
            group.close(abort=True)
        raise
    if group is not None:
        tensor_parallel.register_close(llm, group)
    return llm

