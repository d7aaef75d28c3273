"""`attnzoo serve` and `vllm serve` on the same model shape (random weights), measured by the same client
(bench_serving.py) in one run: each server in its own process, one after the other, on the same port.

Scenarios (issue #33): Llama-3.1-8B shape: random 1024-in/256-out and the GSM8K 8-shot prompts, at
concurrency 100 and 1; Gemma-4-31B shape: random 1024/256 at concurrency 1 and 64. Writes
PREFIX.json (every run's summary, and attnzoo / vLLM ratios), PREFIX.md (the table), PREFIX.png and
PREFIX_<server>.log.

vLLM runs from the overlay of ../shared/gpu/vllm (README there: unpack to /tmp/vsite, Gemma 4 also
/tmp/tf514), never in attnzoo's process. `vllm serve` needs serving packages the offline overlay does not
carry (nor, maybe, the GPU image for attnzoo: fastapi, uvicorn, prometheus_client); ``--check-vllm``
lists which of them either side cannot import (stage their wheels, e.g.
``pip download --no-deps -d wheels uvicorn h11 uvloop httptools prometheus_client
prometheus-fastapi-instrumentator`` here, unpacked with ``pip install --no-deps --target /tmp/vserve``
there, and pass ``--vllm-extra-path /tmp/vserve``).

    python benchmarks/serve_peer.py --shape llama8b --out $OUT/serve_llama8b --vllm-site /tmp/vsite
    python benchmarks/serve_peer.py --shape gemma4-31b --vllm-extra-path /tmp/tf514 \
        --vllm-args '--attention-config {"backend":"TRITON_ATTN"}' --out $OUT/serve_gemma4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import bench_serving  # this directory is sys.path[0] when the script runs
from common import run_meta

HERE = Path(__file__).resolve().parent
# What `vllm serve` imports beyond the offline overlay (vllm/entrypoints, 0.26.0).
VLLM_SERVE_MODULES = ("uvicorn", "h11", "uvloop", "fastapi", "starlette", "prometheus_client",
                      "prometheus_fastapi_instrumentator", "openai", "httpx", "pydantic", "aiohttp", "psutil",
                      "watchfiles", "multipart",
                      "vllm.entrypoints.openai.api_server")  # the server itself: whatever else it imports (sagemaker's)
ATTNZOO_SERVE_MODULES = ("fastapi", "starlette", "pydantic", "anyio", "uvicorn", "h11", "prometheus_client")
SCENARIOS = {
    "llama8b": [("random", 100, 500), ("random", 1, 16), ("gsm8k", 100, 500), ("gsm8k", 1, 16)],
    "gemma4-31b": [("random", 1, 16), ("random", 64, 256)],
}
VOCAB = {"llama8b": 128256, "gemma4-31b": 262144}
WARMUP = 4  # requests before each scenario's measured ones (bench_serving's warm-up, 4 tokens each)


def vllm_env(args) -> dict:
    path = ":".join(p for p in (args.vllm_extra_path, args.vllm_site) if p)
    return dict(os.environ, PYTHONPATH=path, LD_LIBRARY_PATH=f"{args.vllm_site}/xgrammar",
                VLLM_USE_FLASHINFER_SAMPLER="0", TVM_FFI_DISABLE_TORCH_C_DLPACK="1", VLLM_NO_USAGE_STATS="1",
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def missing_modules(modules, env: dict) -> list[str]:
    """The modules that do not import under ``env``, each with what stopped it: a module can be present and
    still fail on one it imports itself (fastapi 0.165 on opentelemetry)."""
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        print(f'{m} ({type(e).__name__}: {e})'.replace(chr(10), ' '))\n")
    out = subprocess.run([sys.executable, "-c", code, *modules], env=env, capture_output=True, text=True)
    return out.stdout.splitlines()


def missing_vllm_modules(args) -> list[str]:
    return missing_modules(VLLM_SERVE_MODULES, vllm_env(args))


def write_model(shape: str, layers: int | None, folder: Path) -> Path:
    from e2e import make_config

    config, _ = make_config(shape, layers)
    config.save_pretrained(folder)
    return folder


class StartFailed(Exception):
    """A server exited or did not answer /health in time (the run goes on with the other server)."""


def start(name: str, cmd: list[str], env: dict, log: Path, port: int, timeout: float) -> subprocess.Popen:
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    try:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                sys.stdout.write("".join(open(log).readlines()[-40:]))
                raise StartFailed(f"{name} exited with {proc.returncode} before serving")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        print(f"  {name} up after {time.time() - t0:.0f} s", flush=True)
                        return proc
            except OSError:
                pass
            time.sleep(2)
        raise StartFailed(f"{name} did not answer /health within {timeout:.0f} s (log: {log})")
    except BaseException:  # its own session: nobody else would stop it (a SIGTERM's SystemExit included)
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    """The server and what it started (vLLM's engine core): its process group, begun by ``start``."""
    def signal_group(sig) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group has already exited
            pass

    signal_group(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        proc.wait()


def scrape(url: str) -> list | None:
    """The samples of the server's /metrics, or None where nothing answers."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def server_ttft(url: str) -> tuple[float, float] | None:
    """(sum s, count) of the server's own time-to-first-token histogram (attnzoo's and vLLM's /metrics both
    have one), or None where it has none: set beside the client's TTFT, it splits the engine's share from the
    HTTP path's."""
    total = {"sum": 0.0, "count": 0.0}
    for sample in scrape(url) or ():
        base, _, part = sample.name.rpartition("_")
        if base.endswith("time_to_first_token_seconds") and part in total:
            total[part] += sample.value
    return (total["sum"], total["count"]) if total["count"] else None


STEP_METRICS = {"attnzoo_engine_step_seconds": "s", "attnzoo_engine_step_host_seconds": "host_s",
                "attnzoo_engine_step_tokens": "tokens"}


def server_steps(url: str) -> dict | None:
    """attnzoo's engine steps so far by kind ("decode", "prompt"): {"steps", "s", "host_s", "tokens"} each, from
    its /metrics (None for a server without them: vLLM)."""
    out: dict = {}
    for sample in scrape(url) or ():
        base, _, part = sample.name.rpartition("_")
        if base in STEP_METRICS and part in ("sum", "count"):
            kind = out.setdefault(sample.labels["kind"], {"steps": 0.0, "s": 0.0, "host_s": 0.0, "tokens": 0.0})
            kind["steps" if part == "count" else STEP_METRICS[base]] = sample.value
    return out or None


def step_delta(before: dict | None, after: dict | None) -> dict | None:
    """What ``server_steps`` counted between two reads: a scenario's steps by kind, with their mean ms."""
    if after is None:
        return None
    out = {}
    for kind, a in after.items():
        b = (before or {}).get(kind, {})
        d = {k: v - b.get(k, 0.0) for k, v in a.items()}
        if d["steps"] > 0:
            out[kind] = {"steps": int(d["steps"]), "s": round(d["s"], 3), "host_s": round(d["host_s"], 3),
                         "tokens": int(d["tokens"]), "ms_mean": round(1e3 * d["s"] / d["steps"], 2)}
    return out


def measure(label: str, args, model: str) -> list[dict]:
    rows = []
    # Each scenario has prompts of its own (random: seed = its index; GSM8K: the questions after the earlier
    # scenarios'): a prompt an earlier scenario sent would be served from the prefix cache, and its TTFT would
    # not measure a prefill. The few-shot prefix itself is shared, as it is meant to be.
    first_question = 0
    for seed, (dataset, conc, n) in enumerate(SCENARIOS[args.shape]):
        num_prompts = max(1, int(n * args.prompts_scale))
        if getattr(args, "scenarios", None) and f"{dataset}_c{conc}" not in args.scenarios:
            if dataset == "gsm8k":  # skipped, its questions still reserved: the others' stay those of a full run
                first_question += WARMUP + num_prompts
            continue
        snap: list = []  # the server's TTFT counters once the warm-up is done
        url = f"http://127.0.0.1:{args.port}"
        ns = argparse.Namespace(base_url=url, model=model, api_key=None, dataset=dataset,
                                input_len=args.input_len, output_len=args.output_len,
                                num_prompts=num_prompts, vocab_size=VOCAB[args.shape],
                                min_token_id=10, gsm8k_tokens=str(bench_serving.GSM8K_TOKENS), max_concurrency=conc,
                                request_rate=math.inf, warmup=WARMUP, seed=seed, label=label, first_question=first_question,
                                after_warmup=lambda: snap.append((server_ttft(url), server_steps(url))))
        if dataset == "gsm8k":
            first_question += ns.warmup + ns.num_prompts
        results, wall = asyncio.run(bench_serving.run(ns))
        s = bench_serving.summarize(ns, results, wall)
        ttft0, steps0 = snap[0] if snap else (None, None)
        before, after = ttft0 or (0.0, 0.0), server_ttft(url)
        if after is not None and after[1] > before[1]:  # the measured requests' only: read after the warm-up
            s["server_ttft_ms_mean"] = round(1e3 * (after[0] - before[0]) / (after[1] - before[1]), 2)
            print(f"  server-side TTFT mean {s['server_ttft_ms_mean']} ms", flush=True)
        steps = step_delta(steps0, server_steps(url))
        if steps:  # where the engine's time went: how many prompt steps the arrivals made, and their cost
            s["server_steps"] = steps
            print("  server steps: " + ", ".join(f"{k} {v['steps']} x {v['ms_mean']} ms (host {v['host_s']} s)"
                                                 for k, v in steps.items()), flush=True)
        print(bench_serving.table([s]).splitlines()[-1], flush=True)
        rows.append(s)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output prefix")
    ap.add_argument("--shape", default="llama8b", choices=tuple(SCENARIOS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    ap.add_argument("--servers", default="attnzoo,vllm")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-scale", type=float, default=1.0, help="scale every scenario's request count")
    ap.add_argument("--attnzoo-args", default="", help="more `attnzoo serve` arguments, e.g. '--backend flashinfer'")
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--vllm-extra-path", default="", help="prepended to vLLM's PYTHONPATH (serving wheels, /tmp/tf514)")
    ap.add_argument("--vllm-args", default="", help="more `vllm serve` arguments")
    ap.add_argument("--scenarios", default="", help="only these, e.g. 'random_c1,gsm8k_c1' (default: all of the shape's)")
    ap.add_argument("--check-vllm", action="store_true",
                    help="list the serving modules vLLM's path (and attnzoo's environment) lack, and exit")
    ap.add_argument("--startup-timeout", type=float, default=420)
    args = ap.parse_args(argv)
    known = [f"{d}_c{c}" for d, c, _ in SCENARIOS[args.shape]]
    args.scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if unknown := [name for name in args.scenarios if name not in known]:
        ap.error(f"--scenarios: {', '.join(unknown)} not among {args.shape}'s: {', '.join(known)}")
    if args.check_vllm:
        missing = missing_vllm_modules(args)
        ours = missing_modules(ATTNZOO_SERVE_MODULES, dict(os.environ))
        print("vllm serve would need:", "; ".join(missing) or "nothing more")
        print("attnzoo serve would need:", "; ".join(ours) or "nothing more")
        return 1 if missing or ours else 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = write_model(args.shape, args.layers, Path(tempfile.mkdtemp(prefix=f"serve_{args.shape}_")))
    name = f"{args.shape}-random"
    commands = {
        "attnzoo": ([sys.executable, "-m", "attnzoo", "serve", str(model), "--load-format", "random", "--port",
                     str(args.port), "--served-model-name", name, "--log-level", "warning",
                     *shlex.split(args.attnzoo_args)], dict(os.environ)),
        "vllm": ([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--load-format", "dummy",
                  "--skip-tokenizer-init", "--dtype", "bfloat16", "--port", str(args.port), "--served-model-name",
                  name, "--max-model-len", "4096", *shlex.split(args.vllm_args)],
                 vllm_env(args)),
    }
    rows, failed = [], []
    for server in args.servers.split(","):
        if server == "vllm" and (missing := missing_vllm_modules(args)):
            print(f"skipping vllm: on its PYTHONPATH these do not import: {'; '.join(missing)} (see --check-vllm)",
                  flush=True)
            continue
        cmd, env = commands[server]
        try:
            proc = start(server, cmd, env, Path(f"{out}_{server}.log"), args.port, args.startup_timeout)
        except StartFailed as e:  # the other server's rows are still written; the run still fails (not a SIGTERM)
            print(f"skipping {server}: {e}", flush=True)
            failed.append(server)
            continue
        try:
            rows += measure(server, args, name)
        finally:
            stop(proc)
    ratios = {}
    for dataset, conc, _ in SCENARIOS[args.shape]:
        pick = {r["label"]: r for r in rows if r["dataset"] == dataset and r["max_concurrency"] == conc}
        if {"attnzoo", "vllm"} <= pick.keys():
            a, v = pick["attnzoo"], pick["vllm"]
            ratios[f"{dataset}_c{conc}"] = {
                "output_tok_per_s_vs_vllm": a["output_tokens_per_s"] / v["output_tokens_per_s"],
                "itl_p50_vs_vllm": (a["itl_ms"]["p50"] or math.nan) / (v["itl_ms"]["p50"] or math.nan)}
    # After the servers stopped: the device query opens a CUDA context, which must not take a server's memory.
    meta = run_meta(shape=args.shape, layers=args.layers, commands={k: " ".join(c) for k, (c, _) in commands.items()})
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": rows, "ratios": ratios}, indent=1))
    text = bench_serving.table(rows)
    out.with_suffix(".md").write_text(text + "\n\n" + json.dumps(ratios, indent=1) + "\n")
    print(text)
    print(json.dumps(ratios, indent=1))
    bench_serving.plot(rows, out.with_suffix(".png"))
    return 1 if failed else 0


if __name__ == "__main__":
    # A timeout's SIGTERM unwinds like Ctrl-C, so the servers (in sessions of their own) are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
