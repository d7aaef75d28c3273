"""The ``attnzoo`` command line: ``generate``, ``serve``, ``info``, ``policy`` (show / explain / backends), ``tune``
and ``download-default-model``."""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

from attnzoo.attention.kv_cache import KV_CACHE_DTYPES
from attnzoo.console import setup_logging
from attnzoo.errors import AttnzooError, ModelLoadError, PolicyError, RequestError, UnsupportedArchitectureError

GPU_NAMES = "cpu, sm80, sm89, sm90, sm100, sm103, sm120"
OPTIONAL_PACKAGES = ("flashinfer", "triton")  # what optional backends import; --assume-installed pretends they do


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
    p.add_argument("--k-scale", type=float, default=1.0, help="fp8 KV cache: the per-tensor scale of k (default 1.0)")
    p.add_argument("--v-scale", type=float, default=1.0, help="fp8 KV cache: the per-tensor scale of v (default 1.0)")


def _load(args, **extra):
    from attnzoo import load_model

    return load_model(
        args.model, backend=args.backend, prefill_backend=args.prefill_backend, decode_backend=args.decode_backend,
        page_size=args.page_size, policy_file=args.policy, dtype=args.dtype, device=args.device,
        k_scale=args.k_scale, v_scale=args.v_scale,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype, **extra,
    )


def _generate(args) -> int:
    from attnzoo.engine.sampling import SamplingParams

    # The sampling flags are checked before the model loads (which takes seconds to minutes).
    SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed, tuple(args.stop or ()),
                   ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty).validate()
    n = args.num_return_sequences
    if n < 1 or (n > 1 and args.temperature == 0):
        raise RequestError(f"-n {n}: " + ("must be >= 1" if n < 1 else "greedy decoding returns n identical texts"),
                           fix="pass -n 1, or sample with --temperature > 0")
    from attnzoo.engine.prompts import valid_text

    for i, p in enumerate(args.prompts):  # bytes that are not UTF-8 arrive as lone surrogates
        valid_text(p, f"prompt {i}")
    llm = _load(args)
    print(f"# {llm.architecture}: prefill={llm.decision.prefill_backend} decode={llm.decision.decode_backend} "
          f"page_size={llm.pool.page_size} device={llm.device}", file=sys.stderr)
    has_template = getattr(llm.tokenizer, "chat_template", None) is not None
    if args.chat and not has_template:
        raise ModelLoadError(f"--chat was given but the tokenizer of {llm.source.name} has no chat template",
                             fix="drop --chat (prompts then go in as plain text)")
    chat = has_template if args.chat is None else args.chat  # chat only where a template says how
    prompts = [[{"role": "user", "content": p}] for p in args.prompts] if chat else list(args.prompts)
    outs = llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or None,
                        ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty, num_return_sequences=n)
    for i, out in enumerate(outs):
        prompt = args.prompts[i // n]
        if args.json:
            print(json.dumps({"prompt": prompt, "index": i % n, "chat": chat, "text": out.text,
                              "finish_reason": out.finish_reason, "num_tokens": len(out.token_ids)}))
        else:
            label = f"{prompt} [{i % n + 1}/{n}]" if n > 1 else prompt
            print(f"### {label}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


def _serve(args) -> int:
    try:
        from attnzoo.server.app import run
    except ImportError as e:
        raise AttnzooError(f"serving needs fastapi, uvicorn and prometheus_client ({e})",
                           fix="pip install 'attnzoo[serve]'") from None
    if args.graph_extend_tokens is not None and args.graph_extend_tokens < 0:
        raise AttnzooError(f"--graph-extend-tokens {args.graph_extend_tokens}: must be >= 0",
                           fix="pass 0 (off) or the most new tokens a step may bring to run as decode rows, e.g. 64")
    if args.piecewise_graph_tokens < 0:
        raise AttnzooError(f"--piecewise-graph-tokens {args.piecewise_graph_tokens}: must be >= 0",
                           fix="pass 0 (eager) or the most tokens a step replayed as pieces may hold, e.g. 512")
    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            raise AttnzooError(f"two models given: {args.model_pos!r} and --model {args.model!r}", fix="give one")
        args.model = args.model_pos
    llm = _load(args, load_format=args.load_format, max_batch_tokens=args.max_batch_tokens,
                kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory),
                piecewise_graph_tokens=args.piecewise_graph_tokens)
    if args.graph_extend_tokens is not None:
        llm.engine.graph_extend_tokens = args.graph_extend_tokens
    name = args.served_model_name or (args.model or llm.architecture)
    t0 = time.perf_counter()
    llm.warm_up()  # the first requests must not wait for a kernel's just-in-time compile
    print(f"# kernels warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"# serving {name} ({llm.architecture}: prefill={llm.decision.prefill_backend} "
          f"decode={llm.decision.decode_backend}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        run(llm, model_name=name, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
            log_level=args.log_level)
    finally:
        llm.close()
    return 0


def _info(args) -> int:
    info = _load(args).info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if key == "decision":
            continue  # `attnzoo policy explain` prints it readably; --json carries it
        shown = json.dumps(value, default=str) if isinstance(value, (dict, list)) else value
        print(f"{key:<22} {shown}")
    print("(the full decision: --json, or `attnzoo policy explain MODEL`)")
    return 0


def _download_default_model(args) -> int:
    from attnzoo.models import default_model

    print(default_model.path())  # already here: where it is; else downloaded, checked and extracted first
    return 0


class PlainParser(argparse.ArgumentParser):
    """Help without the docstrings' reStructuredText markup (``name`` prints as name)."""

    def format_help(self) -> str:
        return re.sub(r"``?([^`]+)``?", r"\1", super().format_help())


def build_parser() -> argparse.ArgumentParser:
    from attnzoo import __version__

    parser = PlainParser(prog="attnzoo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
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
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens tokens, past EOS")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' rule (default 1.0: off)")
    g.add_argument("-n", "--num-return-sequences", type=int, default=1, metavar="N",
                   help="sampled texts per prompt (needs --temperature > 0)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt as a user chat message (default: when the tokenizer has a chat template)")
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
    s.add_argument("--graph-extend-tokens", type=int, default=None, metavar="N",
                   help="steps of prompt chunks with at most N new tokens run as decode rows in the CUDA graphs "
                        "(a prompt after a cached prefix, a chat turn); 0: off; default: 64 where the graphs run")
    s.add_argument("--piecewise-graph-tokens", type=int, default=0, metavar="N",
                   help="steps of up to N tokens that the decode graphs do not serve (prompt chunks, mixed steps) "
                        "replay CUDA graphs between their eager attention calls, or whole with the attention "
                        "inside where the backends capture mixed steps (triton); 0 (default): eager")
    s.set_defaults(func=_serve)

    i = sub.add_parser("info", help="load a model and print LLM.info() (backends, page size, KV capacity)")
    _add_model_args(i)
    i.add_argument("--json", action="store_true", help="print LLM.info() as JSON, the decision included")
    i.set_defaults(func=_info)

    d = sub.add_parser("download-default-model",
                       help="fetch the embedded default model (SmolLM2-135M-Instruct GGUF, 93 MB) into the cache now")
    d.set_defaults(func=_download_default_model)

    _add_policy(sub)
    from attnzoo.tune import add_subparser as add_tune

    add_tune(sub)
    return parser


# ------------------------------------------------------------------------------------------ policy

POLICY_HELP = """Print the attention-backend policy table, explain one model's decision, or list the backends.

`explain` reads no weights and never downloads: MODEL_OR_ARCH is an architecture name, a local checkpoint
directory, a .gguf file, a hub id whose config.json is in the local Hugging Face cache, or one of the
zoo's flagship hub ids (answered from the shipped table). --arch names the architecture otherwise.
A --gpu other than this machine's answers what would run there, with the optional packages assumed
installed (said in the output; --assume-installed '' checks this machine's packages instead).
"""


def _add_policy(sub) -> None:
    p = sub.add_parser("policy", help="show the attention-backend policy or explain one model's decision",
                       description=POLICY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="policy_command", required=True)
    show = cmds.add_parser("show", help="print the policy table (every architecture x GPU cell)")
    show.add_argument("--gpu", default=None, help=f"only this GPU: {GPU_NAMES}")
    show.add_argument("--policy", default=None, help="merge this user policy file over the shipped table")
    show.add_argument("--json", action="store_true", help="print JSON, with the full reasons")
    show.set_defaults(func=_policy_show)
    ex = cmds.add_parser("explain", help="resolve one model and print the decision with every candidate's reasons")
    ex.add_argument("model", metavar="MODEL_OR_ARCH", help="architecture name, checkpoint dir, .gguf file or hub id")
    ex.add_argument("--gpu", default=None, help=f"{GPU_NAMES} (default: this machine's)")
    ex.add_argument("--policy", default=None, help="user policy file (TOML, same schema as the shipped table)")
    ex.add_argument("--backend", default=None, help="backend for prefill and decode")
    ex.add_argument("--prefill-backend", default=None)
    ex.add_argument("--decode-backend", default=None)
    ex.add_argument("--page-size", type=int, default=None)
    ex.add_argument("--dtype", default=None, help="the dtype the model will run in (checked against the backends)")
    ex.add_argument("--arch", default=None, help="the architecture, when the model's config.json is not at hand")
    ex.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                    help="what the KV cache will store (backends that cannot read it are refused, as at load)")
    ex.add_argument("--assume-installed", nargs="?", const=",".join(OPTIONAL_PACKAGES), default=None,
                    metavar="PKG[,PKG]", help="answer for a machine that has these packages (default with the flag: "
                    f"{', '.join(OPTIONAL_PACKAGES)}; without it: all of them for another --gpu, none here)")
    ex.add_argument("--json", action="store_true", help="print the Decision as JSON")
    ex.set_defaults(func=_policy_explain)
    caps = cmds.add_parser("backends", help="print every backend's declared capabilities")
    caps.add_argument("--json", action="store_true", help="print JSON")
    caps.set_defaults(func=_policy_backends)


def _short(text: str | None, width: int = 72) -> str:
    text = (text or "").split("; ")[0]
    return text if len(text) <= width else text[: width - 3] + "..."


def _policy_show(args) -> int:
    from tabulate import tabulate

    cells, patterns = table_cells(args.gpu, args.policy), model_patterns(args.gpu, args.policy)
    if args.json:
        print(json.dumps({"cells": cells, "model_patterns": patterns}, indent=2))
        return 0
    rows = []
    for c in cells:
        f = c["field"]
        vs = "-" if f is None else "agrees" if f["agrees"] else (
            "differs, unmeasured" if f["justified_by"] == "unmeasured" else "differs, measured")
        note = f"planned: {c['planned']}" if c["planned"] else c["reason"]
        rows.append((c["architecture"], c["gpu"], c["prefill_backend"], c["decode_backend"], c["page_size"], vs,
                     _short(note)))
    print(tabulate(rows, ("architecture", "gpu", "prefill", "decode", "page", "vs field", "planned / reason"),
                   disable_numparse=True))
    if patterns:
        print("\nmodel-id patterns (applied by `explain` and load_model when the model id matches):")
        print(tabulate([(p["pattern"], p["gpu"], p["prefill"] or "", p["decode"] or "", p["page_size"] or "",
                         f"{p['file']}:{p['line']}") for p in patterns],
                       ("pattern", "gpu", "prefill", "decode", "page", "where"), disable_numparse=True))
    return 0


def table_cells(gpu: str | None = None, policy_file=None, *, table=None) -> list[dict]:
    """Every (architecture, GPU) cell of the table as written, merged by precedence; no capability checks.
    ``policy_file`` (or $ATTNZOO_POLICY) is merged over the shipped table, as resolve() would."""
    from attnzoo.policy.resolve import GPUS, FIELDS, applicable, field_summary, gpu_class, user_table, value_of
    from attnzoo.policy.table import SHIPPED_POLICY, load_table

    shipped = load_table(table or SHIPPED_POLICY, shipped=True)
    user = user_table(policy_file, [])
    cells = []
    for fam in shipped.families.values():
        for arch in fam.archs:
            for g in [gpu_class(gpu)] if gpu else GPUS:
                matches = applicable(shipped, user, arch, fam.name, g, None)
                cell: dict = {"family": fam.name, "architecture": arch, "gpu": g}
                for key in FIELDS:
                    cell[key], src = value_of(matches, key, arch, fam.name, g, shipped)
                    cell[f"{key}_from"] = src.detail
                for key in ("reason", "planned", "measured_in"):
                    cell[key] = next((getattr(m.row, key) for _, _, m in matches if getattr(m.row, key)), None)
                cells.append({**cell, "field": field_summary(matches)})
    return cells


def model_patterns(gpu: str | None = None, policy_file=None, *, table=None) -> list[dict]:
    """The model-id pattern rows of the shipped table and the user policy file ("*" = all GPUs)."""
    from attnzoo.policy.resolve import gpu_class, user_table
    from attnzoo.policy.table import SHIPPED_POLICY, load_table

    want = gpu_class(gpu) if gpu else None
    out = []
    for tbl in (load_table(table or SHIPPED_POLICY, shipped=True), user_table(policy_file, [])):
        for pattern, entry in (tbl.models.items() if tbl else ()):
            for g, row in [("*", entry.all_gpus), *entry.gpus.items()]:
                if (want and g not in ("*", want)) or (row.prefill, row.decode, row.page_size) == (None,) * 3:
                    continue
                out.append({"pattern": pattern, "gpu": g, "prefill": row.prefill, "decode": row.decode,
                            "page_size": row.page_size, "reason": row.reason, "file": str(tbl.path), "line": row.line})
    return out


def _policy_explain(args) -> int:
    from attnzoo.policy.resolve import Overrides, detect_gpu, gpu_class, resolve

    model, model_id, notes = _policy_model(args.model, args.arch)
    here = gpu_class(detect_gpu())
    elsewhere = args.gpu is not None and gpu_class(args.gpu) != here
    given = args.assume_installed
    assume = tuple(p for p in (given if given is not None else ",".join(OPTIONAL_PACKAGES) if elsewhere else "")
                   .split(",") if p)
    unknown = [p for p in assume if p not in OPTIONAL_PACKAGES]
    if unknown:
        raise PolicyError(f"--assume-installed: unknown package(s) {', '.join(unknown)}",
                          fix=f"use some of: {', '.join(OPTIONAL_PACKAGES)}")
    decision = resolve(model, gpu=args.gpu, model_id=model_id, overrides=Overrides(
        backend=args.backend, prefill_backend=args.prefill_backend, decode_backend=args.decode_backend,
        page_size=args.page_size, policy_file=args.policy, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        assume_installed=assume))
    if elsewhere and given is None:
        notes.append(f"--gpu {args.gpu} is not this machine ({here}): the answer is what would run there, with "
                     f"{', '.join(OPTIONAL_PACKAGES)} assumed installed (--assume-installed '' checks this machine's)")
    decision.notes[:0] = notes
    print(json.dumps(decision.to_dict(), indent=2) if args.json else decision.explain())
    return 0


def _policy_model(target: str, arch: str | None):
    """MODEL_OR_ARCH (+ --arch) -> (what resolve() takes: a config or an architecture name, model id, notes)."""
    from attnzoo.models import loader
    from attnzoo.models.registry import architecture_of
    from attnzoo.policy.table import SHIPPED_POLICY, load_table

    table = load_table(SHIPPED_POLICY, shipped=True)
    known = table.architectures()
    if arch is not None and arch not in known:
        raise PolicyError(f"--arch {arch!r} is not an architecture the policy knows", fix=f"use one of: {', '.join(known)}")
    if target in known:
        if arch is not None and arch != target:
            raise PolicyError(f"MODEL_OR_ARCH is architecture {target!r} but --arch says {arch!r}",
                              fix="give the architecture once")
        return target, None, []
    path = Path(target).expanduser()
    try:
        config = loader.load_config(loader.resolve_source(path.parent if path.name == "config.json" else target,
                                                          local_only=True))
    except UnsupportedArchitectureError:  # a family transformers does not know: resolved from its config's keys
        config = json.loads(((path / "config.json") if path.is_dir() else path).read_text(encoding="utf-8"))
    except ModelLoadError:
        if path.exists():
            raise
        config = None
    if config is None:
        flagship = table.flagship(target)
        if arch is None and flagship is None:
            raise PolicyError(
                f"{target!r} is not a known architecture, a local checkpoint, a flagship hub id, or a hub id whose "
                "config.json is in the local Hugging Face cache",
                fix=f"pass --arch ARCH (one of: {', '.join(known)}), or download the config first: "
                    f"hf download {target} config.json")
        note = [] if arch else [f"{target} is in the shipped flagship table: {flagship}, its shape from the table "
                                "(no config read)"]
        return arch or flagship, target, note
    if arch is not None:  # --arch renames the config's architecture: e.g. a multimodal checkpoint as its text model
        config.architectures = [arch]
    elif not architecture_of(config):
        raise PolicyError(f"the config of {target!r} names no architecture", fix="pass --arch ARCH")
    return config, target, []


def _policy_backends(args) -> int:
    from attnzoo.attention.backends import all_capabilities

    data = [dict(c.to_dict(), registered=True) for c in all_capabilities().values()]  # declared = registered
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for d in data:
        print(f"{d['name']} (registered): {d['description']}")
        for phase in ("prefill", "decode"):
            ks = "; ".join(f"{k['kernel']} on {', '.join(k['gpus'])}" for k in d[phase]) or "none"
            print(f"  {phase}: {ks}")
        print(f"  kinds {', '.join(d['kinds'])}; head dims {d['head_dims']}; page sizes {d['page_sizes']}; "
              f"dtypes {', '.join(d['dtypes'])}; sliding window {d['sliding_window']}; "
              f"soft-cap {d['logit_softcap']}; sinks {d['attention_sinks']}; cuda graphs {d['cuda_graph']}; "
              f"cascade {d['cascade']}")
        if d["extra"]:
            print(f'  needs: pip install "attnzoo[{d["extra"]}]" (module {d["module"]})')
        print("".join(f"  note: {n}\n" for n in d["notes"]), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        setup_logging(logging.INFO)
        args = build_parser().parse_args(argv)
        return args.func(args)
    except AttnzooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback through torch
        print("\nattnzoo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
