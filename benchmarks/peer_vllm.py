"""attnzoo and vLLM on the same GSM8K-shaped workload, same shapes, one GPU machine, one run.

Runs benchmarks/e2e.py (attnzoo, the policy's default backend unless ``--backends``) and vLLM's offline
engine (benchmarks/vllm_offline.py: same prompts, the same shape as e2e.py's ``make_config`` builds, random
weights, 256 tokens, EOS ignored, vLLM's defaults: prefix caching, torch.compile, CUDA graphs), each in its
own process one after the other, and writes ONE JSON + table + PNG with both and the ratio.

vLLM never runs in attnzoo's process: its overlay (``--vllm-site``, unpacked as ../shared/gpu/vllm/README.md
says) must not shadow the packages attnzoo imports. Gemma 4 needs the overlay's transformers 5.14
(``--vllm-extra-path /tmp/tf514``).

    python benchmarks/peer_vllm.py --shape llama8b --out $OUT/peer_llama8b --vllm-site /tmp/vsite
    python benchmarks/peer_vllm.py --shape gemma4-31b --vllm-attn-backend TRITON_ATTN --vllm-extra-path /tmp/tf514 ...
    python benchmarks/peer_vllm.py --shape qwen3-30b-a3b --vllm-args "--max-num-seqs 512 --kv-cache-dtype fp8" ...
    python benchmarks/peer_vllm.py --shape llama8b --vllm-configs "default=;fa3=--attn-backend FLASH_ATTN;seqs512=--max-num-seqs 512"

vLLM's FLASHINFER backend needs FlashInfer 0.6.14 (the version vLLM 0.26.0 pins), which the overlay lacks: install
its ``flashinfer-python`` wheel with ``--no-deps --target /tmp/fisite`` (the overlay's apache-tvm-ffi serves it) and
pass ``--vllm-extra-path /tmp/fisite``; its kernels build and autotune on first use (a few minutes on a fresh machine).

``--vllm-configs`` runs vLLM once per named configuration (vllm_offline.py arguments after ``=``) and
compares attnzoo with the fastest of them (``vs_vllm``; ``vs_vllm_default`` against the first). A
configuration vLLM cannot run is recorded with its error beside the others, never dropped silently.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "data" / "gsm8k_8shot_tokens.json"
# Config fields vLLM 0.26 needs beyond ours: its DeepseekV2MoE builds a grouped router from n_group/topk_group
# and raises on transformers' None; one group of all experts is the same routing as "greedy".
VLLM_FIELDS = {"dsv2lite": {"n_group": 1, "topk_group": 1}}


def write_shape(shape: str, layers: int | None, path: Path) -> None:
    """The shape as e2e.py builds it, for vllm_offline.py to rebuild with vLLM's transformers."""
    from e2e import make_config

    config, fields = make_config(shape, layers)
    path.write_text(json.dumps({"name": shape, "config_class": type(config).__name__,
                                "fields": {**fields, **VLLM_FIELDS.get(shape, {})},
                                "architecture": config.architectures[0]}, indent=1))


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """``"name=args;name=args"`` -> [(name, vllm_offline.py arguments)], names unique and file-safe."""
    configs = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, sep, rest = part.partition("=")
        name = name.strip()
        if not sep or not name.replace("_", "").replace("-", "").isalnum():
            raise SystemExit(f"--vllm-configs: {part!r} is not NAME=ARGS (NAME letters, digits, - or _); "
                             f"e.g. \"default=;fp8kv=--kv-cache-dtype fp8\"")
        if name in (n for n, _ in configs):
            raise SystemExit(f"--vllm-configs: {name!r} is named twice")
        configs.append((name, shlex.split(rest)))
    if not configs:
        raise SystemExit("--vllm-configs names no configuration")
    return configs


def vllm_row(name: str, peer: dict, args: list[str] | None = None) -> dict:
    """One vLLM configuration's row of the result: its measurement, or the error it ended with."""
    if "error" not in peer and not peer.get("output_tok_per_s"):
        peer = {"error": "no output_tok_per_s in vllm_offline.py's result"}
    if "error" in peer:
        return {"engine": "vllm", "config": name, "args": args, "backend": f"vLLM ({name}): failed", "error": peer["error"]}
    row = {"engine": "vllm", "config": name, "args": args,
           "backend": f"{peer['engine']} ({name}: {','.join(peer.get('attention_backends', [])) or peer.get('attn_backend_arg')})",
           **{k: peer.get(k) for k in ("output_tok_per_s", "wall_s", "ttft_mean_s", "tpot_mean_ms", "max_num_seqs",
                                       "kv_cache_dtype", "num_gpu_blocks", "block_size", "cached_prompt_tokens")}}
    if peer.get("num_gpu_blocks") and peer.get("block_size"):
        row["kv_cache_tokens"] = peer["num_gpu_blocks"] * peer["block_size"]
    return row


def compare(rows: list[dict], vllm_rows: list[dict]) -> dict:
    """Sets each attnzoo row's ``vs_vllm`` (against the fastest vLLM configuration that ran) and
    ``vs_vllm_default`` (against the first); returns the fastest vLLM row."""
    ran = [r for r in vllm_rows if "error" not in r]
    if not ran:
        raise SystemExit("no vLLM configuration ran: " + "; ".join(f"{r['config']}: {r['error']}" for r in vllm_rows))
    best = max(ran, key=lambda r: r["output_tok_per_s"])
    for r in rows:
        r["vs_vllm"] = r["output_tok_per_s"] / best["output_tok_per_s"]
        if "error" not in vllm_rows[0]:
            r["vs_vllm_default"] = r["output_tok_per_s"] / vllm_rows[0]["output_tok_per_s"]
    return best


def run(cmd: list[str], env: dict, log: Path, check: bool = True) -> int:
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    print(f"  exit {proc.returncode} after {time.perf_counter() - t0:.0f} s (log: {log})", flush=True)
    if proc.returncode:
        sys.stdout.write("".join(open(log).readlines()[-40:]))
        if check:
            raise SystemExit(f"{cmd[1]} failed with exit code {proc.returncode}")
    return proc.returncode


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.png, PREFIX_*.log")
    ap.add_argument("--shape", default="llama8b", help="an e2e.py shape (e2e.py --help lists them)")
    ap.add_argument("--layers", type=int, default=None, help="reduce depth, for both engines")
    ap.add_argument("--backends", default="default", help="attnzoo backends for e2e.py (default: the policy's)")
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts (default: all 1319)")
    ap.add_argument("--e2e-args", default="", help="more e2e.py arguments, e.g. '--cascade both'")
    ap.add_argument("--vllm-site", default="/tmp/vsite", help="the unpacked vLLM overlay (PYTHONPATH for vLLM)")
    ap.add_argument("--vllm-extra-path", default="", help="prepended to vLLM's PYTHONPATH (Gemma 4: /tmp/tf514)")
    ap.add_argument("--vllm-attn-backend", default="auto", help="vLLM's attention backend (default: vLLM's own choice)")
    ap.add_argument("--vllm-args", default="", help="more vllm_offline.py arguments (--max-num-seqs, --kv-cache-dtype)")
    ap.add_argument("--vllm-configs", default=None, metavar="NAME=ARGS;...",
                    help="several vLLM configurations, each NAME=vllm_offline.py arguments (default: one, 'default', "
                         "from --vllm-attn-backend and --vllm-args); attnzoo is compared with the fastest")
    ap.add_argument("--order", choices=("vllm-first", "attnzoo-first"), default="vllm-first")
    ap.add_argument("--reuse-vllm", default=None, metavar="JSON",
                    help="a vllm_offline.py result measured on this same machine earlier in the session (a long "
                         "shape's two engines may not fit one device call): recorded as reused, not re-run")
    ap.add_argument("--reuse-attnzoo", default=None, metavar="JSON",
                    help="an e2e.py result of this shape measured earlier in the session: recorded as reused, not re-run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = ["--prompts", str(args.prompts)] if args.prompts else []
    depth = ["--layers", str(args.layers)] if args.layers else []
    shape_json = Path(f"{out}_shape.json")
    write_shape(args.shape, args.layers, shape_json)

    ours_cmd = [sys.executable, str(HERE / "e2e.py"), "--out", f"{out}_attnzoo", "--shape", args.shape,
                "--backends", args.backends, "--hf-prompts", "0", *n, *depth, *args.e2e_args.split()]
    env_ours = dict(os.environ)
    if args.vllm_configs and (args.vllm_args or args.vllm_attn_backend != "auto"):
        raise SystemExit("--vllm-configs names every vLLM configuration in full: put --vllm-attn-backend / "
                         "--vllm-args into its entries (e.g. \"fi=--attn-backend FLASHINFER\")")
    configs = parse_configs(args.vllm_configs) if args.vllm_configs else [
        ("default", ["--attn-backend", args.vllm_attn_backend, *args.vllm_args.split()])]
    env_vllm = dict(os.environ, PYTHONPATH=":".join(p for p in (args.vllm_extra_path, args.vllm_site) if p),
                    LD_LIBRARY_PATH=f"{args.vllm_site}/xgrammar", VLLM_USE_FLASHINFER_SAMPLER="0",
                    TVM_FFI_DISABLE_TORCH_C_DLPACK="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    jobs = [(f"vllm_{name}", [sys.executable, str(HERE / "vllm_offline.py"), str(WORKLOAD), "--shape-json", str(shape_json),
                              "--out", f"{out}_vllm_{name}.json", *n, *extra], env_vllm) for name, extra in configs]
    jobs.append(("attnzoo", ours_cmd, env_ours))
    if args.order == "attnzoo-first":
        jobs.insert(0, jobs.pop())
    if args.reuse_vllm:
        if len(configs) > 1:
            raise SystemExit("--reuse-vllm stands for one vLLM configuration: drop --vllm-configs")
        jobs = [j for j in jobs if not j[0].startswith("vllm")]
        Path(f"{out}_vllm_{configs[0][0]}.json").write_text(Path(args.reuse_vllm).read_text())
    if args.reuse_attnzoo:
        jobs = [j for j in jobs if j[0] != "attnzoo"]
        Path(f"{out}_attnzoo.json").write_text(Path(args.reuse_attnzoo).read_text())
    for name, cmd, env in jobs:
        # one vLLM configuration failing (a backend this overlay lacks) leaves the others to run
        code = run(cmd, env, Path(f"{out}_{name}.log"), check=not name.startswith("vllm") or len(configs) == 1)
        if code:
            Path(f"{out}_{name}.json").write_text(json.dumps({"error": f"exit {code}: see {out}_{name}.log"}))

    ours = json.loads(Path(f"{out}_attnzoo.json").read_text())
    rows = [r for r in ours["results"] if r.get("engine") == "attnzoo"]
    peers = {name: json.loads(Path(f"{out}_vllm_{name}.json").read_text()) for name, _ in configs}
    vllm_rows = [vllm_row(name, peers[name], extra) for name, extra in configs]
    best = compare(rows, vllm_rows)
    if args.reuse_vllm:
        vllm_rows[0]["reused_from"] = args.reuse_vllm
    for r in rows if args.reuse_attnzoo else []:
        r["reused_from"] = args.reuse_attnzoo
    peer = peers[best["config"]]
    result = {"meta": {**ours["meta"], "peer": {k: v for k, v in peer.items() if k not in best}},
              "attnzoo": rows, "vllm": best, "vllm_configs": vllm_rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))

    print(f"\n{args.shape} on {ours['meta']['device']}, {rows[0]['prompts']} prompts x {rows[0]['output_tokens'] // rows[0]['prompts']} tokens")
    print(f"{'engine':60s} {'tok/s':>8s} {'vs vLLM':>8s} {'TTFT s':>7s} {'TPOT ms':>8s} {'KV tokens':>10s} {'roofline':>8s}")
    nan = float("nan")
    for r in [*rows, *vllm_rows]:
        if "error" in r:
            print(f"{r['backend'][:60]:60s} {r['error']}")
            continue
        print(f"{r['backend'][:60]:60s} {r['output_tok_per_s']:8.0f} {r.get('vs_vllm', r['output_tok_per_s'] / best['output_tok_per_s']):8.2f} "
              f"{r.get('ttft_mean_s') or nan:7.2f} {r.get('tpot_mean_ms') or nan:8.1f} "
              f"{r.get('kv_cache_tokens') or 0:10d} {r.get('roofline_fraction', nan):8.2f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ran = [r for r in vllm_rows if "error" not in r]
        everything = [*rows, *ran]
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(everything)))
        ax.barh([r["backend"][:45] for r in everything], [r["output_tok_per_s"] for r in everything],
                color=["tab:blue"] * len(rows) + ["tab:gray"] * len(ran))
        for i, r in enumerate(everything):
            ratio = r["output_tok_per_s"] / best["output_tok_per_s"]
            ax.text(r["output_tok_per_s"], i, f" {r['output_tok_per_s']:,.0f} ({ratio:.2f}x the fastest vLLM)", va="center")
        ax.set_xlabel("output tokens/s")
        ax.set_title(f"GSM8K workload, {args.shape} shape, {ours['meta']['device']}")
        ax.margins(x=0.25)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG chart")


if __name__ == "__main__":
    main()
