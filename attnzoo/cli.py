"""The ``attnzoo`` command line: ``generate``, ``serve``, ``info``, ``policy`` (show / explain) and ``tune``."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from attnzoo.attention.kv_cache import KV_CACHE_DTYPES
from attnzoo.errors import AttnzooError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local dir, hub id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, help="attention backend for prefill and decode")
    p.add_argument("--prefill-backend", default=None)
    p.add_argument("--decode-backend", default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--policy", default=None, help="user policy file (TOML, same schema as the shipped table)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split the model over N GPUs (default: 1, or WORLD_SIZE under torchrun)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help="what the KV cache stores (auto: the model dtype; fp8_e4m3: per-tensor scales 1.0)")


def _load(args, **extra):
    from attnzoo import load_model

    return load_model(
        args.model, backend=args.backend, prefill_backend=args.prefill_backend, decode_backend=args.decode_backend,
        page_size=args.page_size, policy_file=args.policy, dtype=args.dtype, device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype, **extra,
    )


def _generate(args) -> int:
    from attnzoo.engine.sampling import SamplingParams

    # The sampling flags are checked before the model loads (which takes seconds to minutes).
    SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                   tuple(args.stop or ())).validate()
    llm = _load(args)
    print(f"# {llm.architecture}: prefill={llm.decision.prefill_backend} decode={llm.decision.decode_backend} "
          f"page_size={llm.pool.page_size} device={llm.device}", file=sys.stderr)
    prompts = [[{"role": "user", "content": p}] for p in args.prompts] if args.chat else list(args.prompts)
    outs = llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    for prompt, out in zip(args.prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                              "num_tokens": len(out.token_ids)}))
        else:
            print(f"### {prompt}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


def _serve(args) -> int:
    try:
        from attnzoo.server.app import run
    except ImportError as e:
        raise AttnzooError(f"serving needs fastapi, uvicorn and prometheus_client ({e})",
                           fix="pip install 'attnzoo[serve]'") from None
    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            raise AttnzooError(f"two models given: {args.model_pos!r} and --model {args.model!r}", fix="give one")
        args.model = args.model_pos
    llm = _load(args, load_format=args.load_format, max_batch_tokens=args.max_batch_tokens,
                kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory))
    name = args.served_model_name or (args.model or llm.architecture)
    print(f"# serving {name} ({llm.architecture}: prefill={llm.decision.prefill_backend} "
          f"decode={llm.decision.decode_backend}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        run(llm, model_name=name, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
            log_level=args.log_level)
    finally:
        llm.close()
    return 0


def _info(args) -> int:
    print(json.dumps(_load(args).info(), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_model_args(g)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt as a user chat message (default on)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help="the model (as --model)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="requests waiting for admission before new ones get 503 + Retry-After")
    s.add_argument("--log-level", default="info")
    s.add_argument("--load-format", default="auto", choices=("auto", "random"),
                   help="random: weights drawn at random from MODEL's config.json (benchmarks)")
    s.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step (default: the engine's)")
    s.add_argument("--kv-cache-memory", type=float, default=None, help="bytes for the KV cache (default: the engine's)")
    s.set_defaults(func=_serve)

    i = sub.add_parser("info", help="load a model and print LLM.info() (backends, page size, KV capacity)")
    _add_model_args(i)
    i.set_defaults(func=_info)

    from attnzoo.defaults.cli import add_subparser
    from attnzoo.tune import add_subparser as add_tune

    add_subparser(sub)
    add_tune(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AttnzooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
