"""``attnzoo policy show|explain|backends``: print the policy table, one model's decision, or capabilities.

``explain`` needs no weights: MODEL_OR_ARCH is an architecture name, a local checkpoint directory (its
config.json), a config.json or .gguf file, or a hub id whose config.json is in the local Hugging Face
cache. It never downloads; ``--arch`` names the architecture when the config is not at hand.

The ``attnzoo`` entry point (attnzoo/cli.py) mounts this with ``add_subparser``; ``python -m
attnzoo.defaults.cli policy ...`` runs it alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnzoo.errors import AttnzooError, PolicyError

# The packages optional backends need (pip extras); --assume-installed pretends they import.
OPTIONAL_PACKAGES = ("flashinfer", "triton")


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add ``policy`` (with show / explain / backends) to an argparse subparsers object."""
    p = subparsers.add_parser("policy", help="show the attention-backend policy or explain one model's decision",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="policy_command", required=True)

    show = sub.add_parser("show", help="print the policy table (every architecture x GPU cell)")
    show.add_argument("--gpu", default=None, help="only this GPU: cpu, sm80, sm89, sm90, sm100, sm103, sm120")
    show.add_argument("--policy", default=None, help="merge this user policy file over the shipped table")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=run)

    ex = sub.add_parser("explain", help="resolve one model and print the decision with every candidate's reasons")
    ex.add_argument("model", metavar="MODEL_OR_ARCH",
                    help="architecture name, local checkpoint dir, config.json / .gguf file, or cached hub id")
    ex.add_argument("--gpu", default=None, help="cpu, sm80, sm89, sm90, sm100, sm103, sm120 (default: this machine's)")
    ex.add_argument("--policy", default=None, help="user policy file (TOML, same schema as the shipped table)")
    ex.add_argument("--backend", default=None, help="backend for prefill and decode")
    ex.add_argument("--prefill-backend", default=None)
    ex.add_argument("--decode-backend", default=None)
    ex.add_argument("--page-size", type=int, default=None)
    ex.add_argument("--dtype", default=None, help="the dtype the model will run in (checked against the backends)")
    ex.add_argument("--arch", default=None, help="the architecture, when the model's config.json is not at hand")
    ex.add_argument("--assume-installed", nargs="?", const=",".join(OPTIONAL_PACKAGES), default=None,
                    metavar="PKG[,PKG]",
                    help="answer for a machine that has these packages (default: all optional ones: "
                         f"{', '.join(OPTIONAL_PACKAGES)}); with --gpu, what would run THERE. The answer is "
                         "labelled hypothetical")
    ex.add_argument("--json", action="store_true", help="print the Decision as JSON")
    ex.set_defaults(func=run)

    caps = sub.add_parser("backends", help="print every backend's declared capabilities")
    caps.add_argument("--json", action="store_true", help="print JSON")
    caps.set_defaults(func=run)
    return p


def run(args) -> int:
    """Handler for every ``policy`` subcommand. Raises AttnzooError on bad input (attnzoo.cli reports it)."""
    if args.policy_command == "show":
        return _show(args)
    if args.policy_command == "explain":
        return _explain(args)
    return _backends(args)


def _show(args) -> int:
    from attnzoo.defaults.resolve import model_patterns, table_cells

    cells = table_cells(args.gpu, args.policy)
    patterns = model_patterns(args.gpu, args.policy)
    if args.json:
        print(json.dumps({"cells": cells, "model_patterns": patterns}, indent=2))
        return 0
    head = ("architecture", "gpu", "prefill", "decode", "page", "vs field", "planned / reason")
    rows = []
    for c in cells:
        note = f"planned: {c['planned']}" if c["planned"] else (c["reason"] or "")
        f = c["field"]
        vs = "-" if f is None else "agrees" if f["agrees"] else (
            "differs, unmeasured" if f["justified_by"] == "unmeasured" else "differs, measured")
        rows.append((c["architecture"], c["gpu"], c["prefill_backend"], c["decode_backend"], str(c["page_size"]),
                     vs, note))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(6)]
    for r in [head, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[6])
    if patterns:
        print("\nmodel-id patterns (applied by `explain` and load_model when the model id matches):")
        for p in patterns:
            fields = ", ".join(f"{k}={p[k]}" for k in ("prefill", "decode", "page_size") if p[k] is not None)
            print(f"  {p['pattern']:30} {p['gpu']:6} {fields}   ({p['file']}:{p['line']})")
    return 0


def _explain(args) -> int:
    from attnzoo.defaults.resolve import Overrides, resolve

    model, model_id = load_model_arg(args.model, args.arch)
    assume = tuple(p for p in (args.assume_installed or "").split(",") if p)
    unknown = [p for p in assume if p not in OPTIONAL_PACKAGES]
    if unknown:
        raise PolicyError(f"--assume-installed: unknown package(s) {', '.join(unknown)}",
                          fix=f"use some of: {', '.join(OPTIONAL_PACKAGES)}")
    decision = resolve(
        model, gpu=args.gpu,
        overrides=Overrides(backend=args.backend, prefill_backend=args.prefill_backend,
                            decode_backend=args.decode_backend, page_size=args.page_size,
                            policy_file=args.policy, dtype=args.dtype, assume_installed=assume),
        model_id=model_id,
    )
    print(json.dumps(decision.to_dict(), indent=2) if args.json else decision.explain())
    return 0


def _backends(args) -> int:
    from attnzoo.attention.backends import all_capabilities

    # Declarations live on the registered backend classes: every backend listed is registered.
    data = [dict(c.to_dict(), registered=True) for c in all_capabilities().values()]
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
        for n in d["notes"]:
            print(f"  note: {n}")
    return 0


def load_model_arg(target: str, arch: str | None = None):
    """MODEL_OR_ARCH (+ --arch) -> (what resolve() takes: config dict/object or arch name, model id or None)."""
    from attnzoo.defaults.profile import architecture_of
    from attnzoo.defaults.table import SHIPPED_POLICY, load_table

    known = load_table(SHIPPED_POLICY, shipped=True).architectures()
    if arch is not None and arch not in known:
        raise PolicyError(f"--arch {arch!r} is not an architecture the policy knows",
                          fix=f"use one of: {', '.join(known)}")
    if target in known:
        if arch is not None and arch != target:
            raise PolicyError(f"MODEL_OR_ARCH is architecture {target!r} but --arch says {arch!r}",
                              fix="give the architecture once")
        return target, None

    config = _read_config(target)
    if config is None:
        if arch is None:
            raise PolicyError(
                f"{target!r} is not a known architecture, a local checkpoint, or a hub id whose config.json "
                "is in the local Hugging Face cache",
                fix=f"pass --arch ARCH (one of: {', '.join(known)}), or download the config first: "
                    f"hf download {target} config.json",
            )
        return arch, target
    if arch is not None:
        # --arch renames the config's architecture: e.g. read a multimodal checkpoint as its text model.
        config = dict(config) if isinstance(config, dict) else config
        if isinstance(config, dict):
            config["architectures"] = [arch]
        else:
            config.architectures = [arch]
    elif not architecture_of(config):
        raise PolicyError(f"the config of {target!r} names no architecture", fix="pass --arch ARCH")
    return config, target


def _read_config(target: str):
    """The config of a local dir / config.json / .gguf / cached hub id, or None when not found locally."""
    p = Path(target).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return _read_json(p / "config.json")
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_config(ggufs[0])
        raise PolicyError(f"directory {target!r} has no config.json", fix="point at a checkpoint directory, or pass --arch")
    if p.is_file():
        if p.suffix == ".gguf":
            return _gguf_config(p)
        return _read_json(p)
    if p.exists() or "/" not in target or target.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(target, "config.json")
    except Exception:  # malformed repo id and the like: treated as not cached
        return None
    return _read_json(Path(hit)) if isinstance(hit, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PolicyError(f"cannot read {path} as a model config: {e}", fix="point at a valid config.json") from None


def _gguf_config(path: Path):
    from attnzoo.models import loader

    return loader.load_config(loader.resolve_source(str(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnzoo")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AttnzooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
