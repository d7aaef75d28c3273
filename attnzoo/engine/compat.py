"""vLLM's and transformers' spellings of the API, over the one engine.

vLLM: ``attnzoo.LLM(model=..., **engine args)``, ``attnzoo.SamplingParams`` (max_tokens, n, ...),
``llm.generate(prompts, sampling_params)`` and ``llm.chat(messages, sampling_params)`` returning one
``RequestOutput`` per prompt with its ``n`` ``CompletionOutput``s. transformers: the checkpoint's
``generation_config.json`` gives the EOS ids and the sampling defaults, and
``llm.generate(prompts, generation_config=GenerationConfig(...), **overrides)`` reads a
``transformers.GenerationConfig`` as ``model.generate`` does (its unset fields from the checkpoint's, then
transformers' global defaults). Both end in the engine's ``SamplingParams``.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnzoo.engine.sampling import SamplingParams as EngineParams
from attnzoo.errors import ModelLoadError, RequestError


@dataclass(frozen=True, init=False)
class SamplingParams(EngineParams):
    """vLLM's ``SamplingParams`` (its names and defaults: ``max_tokens=16``, ``temperature=1.0``), an
    engine ``SamplingParams`` with ``n``. ``top_k`` -1 or 0: no cut. ``max_tokens=None``: up to the
    context length. ``n`` > 1 with a ``seed``: sample ``j`` of a prompt uses ``seed + j``."""

    n: int = 1

    def __init__(self, n: int = 1, *, max_tokens: int | None = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None, ignore_eos: bool = False,
                 min_tokens: int = 0, repetition_penalty: float = 1.0, logprobs: int | None = None,
                 prompt_logprobs: int | None = None):
        if isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k == -1:
            top_k = 0  # vLLM's "no cut"
        values = dict(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                      stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), ignore_eos=ignore_eos,
                      min_new_tokens=min_tokens, repetition_penalty=repetition_penalty, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs, n=n)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise RequestError(f"n must be an integer >= 1, got {n!r}", fix="pass n=N, the samples per prompt")

    @property
    def max_tokens(self) -> int | None:
        return self.max_new_tokens

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens

    def engine_params(self, sample: int, max_tokens: int) -> EngineParams:
        """The engine's parameters of sample ``sample`` of a prompt, ``max_tokens`` new tokens at most."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineParams)}
        values.update(max_new_tokens=max_tokens, seed=None if self.seed is None else self.seed + sample)
        params = EngineParams(**values)
        params.validate()
        return params


@dataclass
class Logprob:
    """vLLM's Logprob: the log-probability (of the raw logits), its rank among the position's tokens when
    among the ``logprobs`` best (else None), the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result: its ``n`` outputs (vLLM's RequestOutput, finished)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)  # time_to_first_token and latency of output 0 (s)


# ---------------------------------------------------------------------------------------------- loading

# vLLM engine argument -> load_model keyword (a function: its value translated) or None (accepted, no effect here)
def _vllm_kv_dtype(value):
    return {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "auto": "auto"}.get(value, value)


_VLLM_ARGS = {
    "tokenizer": None, "trust_remote_code": None, "skip_tokenizer_init": None, "disable_log_stats": None,
    "dtype": ("dtype", lambda v: None if v == "auto" else v),
    "seed": ("seed", lambda v: 0 if v is None else v),
    "block_size": ("page_size", None),
    "max_num_seqs": ("max_running", None),
    "max_num_batched_tokens": ("max_batch_tokens", None),
    "enable_prefix_caching": ("prefix_caching", lambda v: True if v is None else v),
    "enforce_eager": ("cuda_graph", lambda v: False if v else None),
    "kv_cache_dtype": ("kv_cache_dtype", _vllm_kv_dtype),
    "load_format": ("load_format", lambda v: "random" if v == "dummy" else v),
    "quantization": None,
}


def load_kwargs(model, kwargs: dict, load_model) -> dict:
    """``load_model`` keywords from vLLM's ``LLM(model=..., **engine args)`` (load_model's own names too)."""
    own = set(inspect.signature(load_model).parameters) - {"name_or_path"}
    out: dict[str, Any] = {}
    unknown = []
    for key, value in kwargs.items():
        if key in own:
            out[key] = value
        elif key in _VLLM_ARGS:
            rule = _VLLM_ARGS[key]
            if key == "tokenizer" and value is not None and str(value) != str(model):
                raise ModelLoadError(f"tokenizer={value!r} differs from model={model!r}: attnzoo reads the tokenizer "
                                     "from the checkpoint", fix="drop tokenizer=, or copy the tokenizer files into the checkpoint")
            if key == "quantization" and value not in (None, "fp8"):
                raise ModelLoadError(f"quantization={value!r} is not supported", fix="drop it (FP8 checkpoints load as they are)")
            if rule is not None:
                name, convert = rule
                out[name] = convert(value) if convert else value
        else:
            unknown.append(key)
    if unknown:
        raise ModelLoadError(f"LLM() does not know {', '.join(sorted(unknown))}",
                             fix="use load_model's keywords (help(attnzoo.load_model)) or vLLM's: " + ", ".join(sorted(_VLLM_ARGS)))
    return {"name_or_path": model, **out}


# ------------------------------------------------------------------------------------- generation config

def read_generation_config(directory: Path | None, config):
    """The checkpoint's ``generation_config.json`` (transformers.GenerationConfig), else one made from
    ``config`` (its EOS / BOS / PAD ids), as transformers does."""
    from transformers import GenerationConfig

    if directory is not None and (Path(directory) / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(directory)
        except Exception as e:
            raise ModelLoadError(f"cannot read {Path(directory) / 'generation_config.json'}: {e}",
                                 fix="repair or remove generation_config.json") from e
    try:
        return GenerationConfig.from_model_config(config)
    except Exception:  # a config without the usual token ids: no defaults
        return GenerationConfig()


def eos_ids(gen) -> set[int]:
    e = getattr(gen, "eos_token_id", None)
    return set(e) if isinstance(e, (list, tuple)) else ({e} if e is not None else set())


def default_sampling_params(llm) -> SamplingParams:
    """vLLM's ``get_default_sampling_params``: the checkpoint's sampling defaults over vLLM's."""
    gen = getattr(llm, "generation_config", None)
    values: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("repetition_penalty", "repetition_penalty"), ("max_tokens", "max_new_tokens")):
        value = getattr(gen, theirs, None)
        if value is not None:
            values[ours] = value
    if gen is not None and getattr(gen, "do_sample", None) is False:
        values["temperature"] = 0.0
    return SamplingParams(**values)


_GC_SUPPORTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty",
                 "num_return_sequences", "min_new_tokens", "stop_strings", "eos_token_id"}
# Fields that change nothing here (token ids the engine reads elsewhere, output formatting, cache choices).
_GC_IGNORED = {"pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "return_dict_in_generate",
               "output_scores", "output_logits", "output_attentions", "output_hidden_states", "transformers_version",
               "cache_implementation", "min_length", "num_beams", "typical_p", "length_penalty", "early_stopping"}


def generation_kwargs(llm, generation_config, given: dict) -> dict:
    """generate()'s keywords for ``generation_config`` (a transformers.GenerationConfig) with the keywords
    ``given`` overriding it, transformers' order: given > generation_config > the checkpoint's > defaults."""
    from transformers import GenerationConfig

    if not isinstance(generation_config, GenerationConfig):
        raise RequestError(f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}",
                           fix="pass GenerationConfig(max_new_tokens=..., do_sample=...), or plain keywords")
    gc = GenerationConfig.from_dict(generation_config.to_dict())
    given = dict(given)
    gc_keys = {k: given.pop(k) for k in list(given) if k in _GC_SUPPORTED}
    if "stop" in given:
        gc_keys["stop_strings"] = given.pop("stop")
    bad = sorted(k for k, v in gc.to_diff_dict().items()
                 if k not in _GC_SUPPORTED | _GC_IGNORED and v not in (None, False, 0, 1, 1.0, 0.0, [], {}))
    bad += [k for k in ("num_beams",) if (getattr(gc, k, None) or 1) != 1]
    if bad:
        raise RequestError(f"generation_config sets {', '.join(bad)}, which attnzoo does not implement",
                           fix="unset them; supported: " + ", ".join(sorted(_GC_SUPPORTED)))
    gc.update(**gc_keys)
    model_gc = getattr(llm, "generation_config", None)
    if model_gc is not None:
        gc.update(**{k: v for k, v in model_gc.to_dict().items() if k in _GC_SUPPORTED}, defaults_only=True)
    gc.update(**{k: v for k, v in GenerationConfig._get_default_generation_params().items() if k in _GC_SUPPORTED},
              defaults_only=True)
    extra_eos = eos_ids(gc) - set(llm.engine.eos)
    if extra_eos and not given.get("ignore_eos"):
        raise RequestError(f"generation_config names EOS ids {sorted(extra_eos)} that the model does not stop on "
                           f"({sorted(llm.engine.eos)})", fix="add them to the checkpoint's generation_config.json, or pass a stop string")
    out = dict(given)
    if gc.max_new_tokens is not None:
        out["max_new_tokens"] = gc.max_new_tokens
    else:
        out["max_length"] = gc.max_length
    out.update(do_sample=bool(gc.do_sample), temperature=float(gc.temperature), top_p=float(gc.top_p),
               top_k=int(gc.top_k or 0) if gc.do_sample else 0, repetition_penalty=float(gc.repetition_penalty),
               num_return_sequences=int(gc.num_return_sequences), min_new_tokens=int(gc.min_new_tokens or 0))
    if not gc.do_sample:
        out["temperature"] = 0.0
    if gc.stop_strings:
        out["stop"] = gc.stop_strings
    return out


def given_keywords(method, local: dict) -> dict:
    """The keywords of a call to ``method`` whose values differ from their defaults (``local``: its locals())."""
    params = inspect.signature(method).parameters
    out = {k: local[k] for k, p in params.items()
           if k in local and k != "generation_config" and p.kind is p.KEYWORD_ONLY and local[k] is not p.default and local[k] != p.default}
    out.update(local.get("unsupported") or {})
    return out


# --------------------------------------------------------------------------------------------- requests

def _prompt_of(item):
    """vLLM's prompt forms: text, token ids, chat messages, {"prompt": text} or {"prompt_token_ids": ids}."""
    if isinstance(item, dict) and "role" not in item:
        if "prompt_token_ids" in item:
            return list(item["prompt_token_ids"])
        if "prompt" in item:
            return item["prompt"]
        raise RequestError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(item)}",
                           fix="pass {'prompt': 'text'} or {'prompt_token_ids': [ids]}")
    return item


def run_requests(llm, prompts, sampling_params, *, use_tqdm: bool | None = None, chat: bool = False,
                 progress=None) -> list[RequestOutput]:
    """vLLM's generate/chat: one RequestOutput per prompt, each with ``n`` outputs (``progress(total)``: the
    on_finish hook shown when ``use_tqdm``, or the model's progress setting, asks for one)."""
    single = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, dict)) and not (
            not chat and isinstance(prompts[0], dict) and "role" not in prompts[0]))
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise RequestError("no prompts given", fix="pass at least one prompt")
    if sampling_params is None:
        sampling_params = default_sampling_params(llm)
    per_prompt = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
    if len(per_prompt) != len(batch):
        raise RequestError(f"{len(per_prompt)} SamplingParams for {len(batch)} prompts", fix="pass one, or one per prompt")
    for sp in per_prompt:
        if not isinstance(sp, SamplingParams):
            # the engine's own SamplingParams has the same name: say which one came
            raise RequestError(f"sampling_params must be attnzoo.SamplingParams, got {type(sp).__module__}."
                               f"{type(sp).__qualname__}",
                               fix="build it with attnzoo.SamplingParams(max_tokens=..., n=..., ...)")
    raw = [_prompt_of(p) for p in batch]
    if chat and any(not (isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p)) for p in raw):
        raise RequestError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of them",
                           fix="pass [{'role': 'user', 'content': 'Hi!'}], or use generate() for text")
    encoded = [llm._encode(p) for p in raw]
    ids, params = [], []
    for prompt, sp in zip(encoded, per_prompt):
        room = llm.engine.context_len - len(prompt)
        for j in range(sp.n):
            ids.append(prompt)
            params.append(sp.engine_params(j, room if sp.max_tokens is None else sp.max_tokens))
    show = llm.progress if use_tqdm is None else bool(use_tqdm)
    on_finish = progress(len(ids)) if show and progress is not None else None
    with llm._lock:
        outs = llm.engine.generate(ids, params, on_finish=on_finish)
    if on_finish is not None:
        on_finish.close(outs)
    results, at = [], 0
    for i, (p, prompt, sp) in enumerate(zip(raw, encoded, per_prompt)):
        group = outs[at: at + sp.n]
        at += sp.n
        results.append(RequestOutput(
            request_id=str(i), prompt=p if isinstance(p, str) else None, prompt_token_ids=prompt,
            outputs=[_completion_output(llm, j, c, sp) for j, c in enumerate(group)],
            prompt_logprobs=None if sp.prompt_logprobs is None else [
                None if t is None else _position(llm, t) for t in group[0].prompt_logprobs],
            metrics={"time_to_first_token": group[0].time_to_first_token, "latency": group[0].latency}))
    return results


def _decode(llm, token: int) -> str | None:
    return None if llm.tokenizer is None else llm.tokenizer.decode([token])


def _position(llm, t) -> dict[int, Logprob]:
    out = {tok: Logprob(lp, rank, _decode(llm, tok)) for rank, (tok, lp) in enumerate(t.top, start=1)}
    if t.token not in out:
        out = {t.token: Logprob(t.logprob, None, _decode(llm, t.token)), **out}
    return out


def _completion_output(llm, index: int, c, sp: SamplingParams) -> CompletionOutput:
    logprobs = None if sp.logprobs is None else [_position(llm, t) for t in c.logprobs]
    cumulative = None if sp.logprobs is None else float(sum(t.logprob for t in c.logprobs))
    return CompletionOutput(index, c.text, list(c.token_ids), cumulative, logprobs, c.finish_reason)
