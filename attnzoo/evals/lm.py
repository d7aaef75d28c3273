"""The lm-eval model class ``attnzoo``: lm-evaluation-harness requests answered by our engine.

Tokenisation follows lm-eval's own ``hf`` model (same special-token rules, same left truncation, same
stop-string handling), so that a task scored through ``attnzoo`` and through ``hf`` on the same
checkpoint differs only by the arithmetic of the forward pass.

Importing this module registers the class in lm-eval's model registry as ``attnzoo`` (lm-eval's own
``@register_model`` convention: lm-eval 0.4.13 has no plugin entry points, so a model module registers
itself), after which ``lm_eval.simple_evaluate(model="attnzoo", model_args="pretrained=...")`` resolves it;
``simple_evaluate(model=AttnzooLM(...))`` needs no registry at all.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from attnzoo.errors import EvalError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # the evals extra is optional
    raise EvalError(
        f"lm-evaluation-harness is not installed ({e})", fix="pip install 'attnzoo[evals]' (or lm_eval==0.4.13)"
    ) from None

log = logging.getLogger("attnzoo")

MODEL_NAME = "attnzoo"
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "do_sample")


@dataclass
class GenerationRecord:
    """What the engine did for one generate_until request (for the report)."""

    task_name: str | None
    doc_id: int | None
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    text: str
    prompt_ids: list[int]
    output_ids: list[int]  # the generated tokens (the report keeps them: teacher forcing replays them)
    # seconds from the engine call's start (its wave's) to the first and to the last token
    ttft_s: float | None = None
    latency_s: float | None = None


# lm_eval.models (imported above through lm_eval.models.utils) has filled the registry with lm-eval's own
# models first: lm-eval's get_model imports them only while the registry is empty.
@register_model(MODEL_NAME)
class AttnzooLM(TemplateLM):
    """An ``LLM`` from :func:`attnzoo.load_model` behind lm-eval's model interface.

    ``generate_until`` hands the requests to the engine in waves of ``wave_size`` (default: all at
    once); the engine batches each wave continuously and the progress bar moves as each request
    finishes. Results come back in the original order.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        backend: str | None = None,
        prefill_backend: str | None = None,
        decode_backend: str | None = None,
        page_size: int | None = None,
        policy_file: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        wave_size: int | None = None,
        kv_cache_tokens: int | None = None,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        # lm-eval's CLI passes these to every model; the engine schedules its own batches.
        batch_size: Any = None,
        max_batch_size: Any = None,
        llm=None,
        **unknown,
    ):
        super().__init__()
        if unknown:
            raise EvalError(
                f"unknown model argument(s) for the attnzoo model: {', '.join(sorted(unknown))}",
                fix="use pretrained, backend, prefill_backend, decode_backend, page_size, policy_file, dtype, device, "
                "max_gen_toks, max_length, add_bos_token, wave_size, kv_cache_tokens, kv_cache_dtype, k_scale, v_scale, "
                "tensor_parallel_size, data_parallel_size",
            )
        if wave_size is not None and int(wave_size) < 1:
            raise EvalError(f"wave_size must be at least 1, got {wave_size}", fix="pass wave_size=N with N >= 1")
        if llm is None:
            from attnzoo import load_model

            llm = load_model(
                pretrained, backend=backend, prefill_backend=prefill_backend, decode_backend=decode_backend,
                page_size=page_size, policy_file=policy_file, dtype=dtype, device=device,
                kv_cache_tokens=kv_cache_tokens, kv_cache_dtype=kv_cache_dtype,
                k_scale=float(k_scale), v_scale=float(v_scale),
                tensor_parallel_size=int(tensor_parallel_size) if tensor_parallel_size else None,
                data_parallel_size=int(data_parallel_size) if data_parallel_size else None,
            )
        if llm.tokenizer is None:
            raise EvalError(f"{llm.source.name} has no tokenizer", fix="evaluate a checkpoint that ships tokenizer files")
        if batch_size not in (None, 1, "1", "auto") or max_batch_size is not None:
            log.info("attnzoo: batch_size/max_batch_size are ignored; the engine batches all requests itself")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._device = llm.device
        self._rank, self._world_size = 0, 1
        self._max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else int(llm.engine.context_len)
        self.add_bos_token = add_bos_token
        self.wave_size = int(wave_size) if wave_size else None  # None: all requests in one call
        self.pretrained = pretrained
        # Filled by generate_until; read by run_eval's report.
        self.records: list[GenerationRecord] = []
        self.generation_seconds = 0.0

    # lm-eval's CLI adds its own batch_size/device to every model's arguments; a device given in
    # --model_args must win over the CLI's default instead of colliding with it.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        # lm-eval's CLI defaults --device to cuda:0 even without a GPU; then load_model picks instead.
        # A device given in --model_args is the user's and is never replaced.
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            log.info("attnzoo: no CUDA GPU here; ignoring lm-eval's device %s (load_model picks the device)", extra["device"])
            del extra["device"]
        return cls(**arg_dict, **extra)

    # ------------------------------------------------------------------ tokenizer (as lm-eval's hf model)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or self.llm.source.name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs) -> list[int]:
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        # A chat-templated prompt already starts with its BOS text; adding another would double it.
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise EvalError(
                f"--apply-chat-template was asked for but the tokenizer of {self.llm.source.name} has no chat template",
                fix="drop --apply-chat-template, or use an instruct checkpoint with a chat template",
            )
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context_enc, continuation_enc in tqdm(requests, disable=disable_tqdm, desc="attnzoo loglikelihood"):
            if not continuation_enc:
                raise EvalError("a loglikelihood request has an empty continuation", fix="check the task's doc_to_target")
            # Score the last max_length tokens, as lm-eval's hf model does (left truncation).
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            inputs = whole[:-1]
            logits = self.llm.logits(inputs)  # [len(inputs), vocab] float32
            n = len(continuation_enc)
            logprobs = torch.log_softmax(logits[-n:], dim=-1)  # [n, vocab]
            target = torch.tensor(whole[-n:], dtype=torch.int64)
            picked = logprobs.gather(1, target[:, None])[:, 0]
            greedy = bool(torch.equal(logprobs.argmax(dim=-1), target))
            out.append((float(picked.sum()), greedy))
            if key is not None:  # rolling windows have no (context, continuation) key to cache under
                self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="attnzoo loglikelihood_rolling"):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(s for s, _ in scores))
        return out

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        # Requests with different generation settings cannot share one engine call.
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="attnzoo generate_until", unit="q")
        try:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                if max_new >= self.max_length:
                    raise EvalError(
                        f"max_gen_toks={max_new} leaves no room for a prompt within max_length={self.max_length}",
                        fix="lower --max-new-tokens",
                    )
                sampling = self._sampling(kwargs)
                size = self.wave_size or len(indices)
                for start in range(0, len(indices), size):
                    wave = indices[start : start + size]
                    prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_new) for i in wave]
                    t0 = time.perf_counter()
                    completions = self.llm.generate(prompts, max_new_tokens=max_new, stop=until, **sampling,
                                                    on_finish=lambda _: bar.update(1))
                    self.generation_seconds += time.perf_counter() - t0
                    for i, p, c in zip(wave, prompts, completions):
                        text = postprocess_generated_text(c.text, until, None)
                        results[i] = text
                        req = requests[i]
                        self.records.append(GenerationRecord(
                            getattr(req, "task_name", None), getattr(req, "doc_id", None), len(p), len(c.token_ids),
                            c.finish_reason, text, list(p), list(c.token_ids), c.time_to_first_token, c.latency,
                        ))
                        self.cache_hook.add_partial("generate_until", req.args, text)
                    out_tokens = sum(r.output_tokens for r in self.records)
                    bar.set_postfix(tok_s=f"{out_tokens / max(self.generation_seconds, 1e-9):.1f}")
        finally:
            bar.close()
        return results

    @staticmethod
    def _sampling(kwargs: dict) -> dict:
        unknown = sorted(k for k in kwargs if k not in _SAMPLING_KEYS)
        if unknown:
            log.warning("attnzoo: ignoring generation kwargs the engine does not support: %s", ", ".join(unknown))
        do_sample = bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not do_sample:
            return {"temperature": 0.0}
        return {
            "temperature": temperature if temperature > 0 else 1.0,
            "top_p": float(kwargs.get("top_p", 1.0) or 1.0),
            "top_k": int(kwargs.get("top_k", 0) or 0),
            "seed": kwargs.get("seed"),
        }

    # ------------------------------------------------------------------ bookkeeping

    def get_model_info(self) -> dict:
        info = self.llm.info()
        return {"model_name": info["model"], "architecture": info["architecture"],
                "prefill_backend": info["prefill_backend"], "decode_backend": info["decode_backend"],
                "page_size": info["page_size"], "dtype": info["dtype"], "device": info["device"],
                "kv_cache_dtype": info["kv_cache_dtype"], "kv_bytes_per_token": info["kv_bytes_per_token"],
                "decision": self.llm.decision.to_dict()}  # lm-eval's results["config"] carries the whole Decision


def register() -> None:
    """Make ``--model attnzoo`` resolvable in lm-eval's registry. Importing this module already did; kept for
    callers that registered explicitly (idempotent)."""
    from lm_eval.api.registry import model_registry

    if model_registry.get(MODEL_NAME, None) is not AttnzooLM:
        model_registry.register(MODEL_NAME, target=AttnzooLM)
