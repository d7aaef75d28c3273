"""Online serving benchmark against any OpenAI-compatible endpoint (``attnzoo serve``, ``vllm serve``, ...).

Requests go to ``/v1/completions`` as token-id prompts, streamed, greedy, EOS ignored (every request
produces exactly its output length), arriving at ``--request-rate`` per second (Poisson; inf: all at
once) with at most ``--max-concurrency`` in flight. Per request: TTFT (send to first token), ITL (between
streamed tokens), TPOT ((last - first) / (tokens - 1)); overall output tok/s and requests/s over the
run's wall time. Datasets: ``random`` (``--input-len``/``--output-len`` token ids drawn uniformly) and
``gsm8k`` (the 8-shot prompts of benchmarks/data/gsm8k_8shot_tokens.json: prefix + question).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model M --dataset random \\
        --input-len 1024 --output-len 256 --num-prompts 200 --max-concurrency 100 --out results/x.json

The HTTP client is asyncio's own streams (no dependency beyond the standard library); matplotlib draws
the PNG where it is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

GSM8K_TOKENS = Path(__file__).resolve().parent / "data" / "gsm8k_8shot_tokens.json"


@dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def make_prompts(args) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request: the ``warmup`` requests' prompts first, then the
    measured ones, all distinct (a measured prompt the warm-up sent would be a prefix-cache hit). GSM8K
    takes questions from ``first_question`` on."""
    rng = random.Random(args.seed)
    n = args.warmup + args.num_prompts
    if args.dataset == "random":
        return [([rng.randrange(args.min_token_id, args.vocab_size) for _ in range(args.input_len)], args.output_len)
                for _ in range(n)]
    data = json.loads(Path(args.gsm8k_tokens).read_text())
    qs, first = data["questions"], args.first_question
    if n > len(qs):
        raise SystemExit(f"{n} GSM8K requests (warm-up included) but {len(qs)} questions: fewer --num-prompts")
    return [(data["prefix"] + qs[(first + i) % len(qs)], args.output_len) for i in range(n)]


async def _sse_lines(url: str, body: dict, api_key: str | None):
    """POST ``body`` and yield the response's lines (HTTP/1.1, chunked or not); raises on a non-200."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    data = json.dumps(body).encode()
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    writer.write(head.encode() + b"\r\n" + data)
    await writer.drain()
    try:
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            chunked |= k.strip().lower() == "transfer-encoding" and "chunked" in v.lower()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}")
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buf += await reader.readexactly(size)
                await reader.readline()
            else:
                piece = await reader.read(65536)
                if not piece:
                    break
                buf += piece
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.strip()
        if buf.strip():
            yield buf.strip()
    finally:
        writer.close()


async def one_request(url: str, model: str, prompt: list[int], out_len: int, api_key: str | None) -> Result:
    r = Result(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    chunks = 0
    usage = None
    try:
        async for line in _sse_lines(url, body, api_key):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            msg = json.loads(payload)
            if msg.get("usage"):
                usage = msg["usage"]
            if not msg.get("choices"):
                continue
            now = time.perf_counter()
            if last is None:
                r.ttft = now - t0
            else:
                r.itl.append(now - last)
            last = now
            chunks += 1
        r.latency = (last or time.perf_counter()) - t0
        r.output_len = usage["completion_tokens"] if usage else chunks
        r.ok = r.output_len > 0
    except Exception as e:  # noqa: BLE001 - recorded per request, the run goes on
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(args) -> tuple[list[Result], float]:
    prompts = make_prompts(args)
    warm, prompts = prompts[: args.warmup], prompts[args.warmup:]
    url = args.base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed + 1)

    async def limited(p, n):
        async with sem:
            return await one_request(url, args.model, p, n, args.api_key)

    if args.warmup:
        await asyncio.gather(*(one_request(url, args.model, p, 4, args.api_key) for p, _ in warm))
    if getattr(args, "after_warmup", None) is not None:  # e.g. a read of the server's own counters
        args.after_warmup()
    tasks = []
    t0 = time.perf_counter()
    for p, n in prompts:
        tasks.append(asyncio.create_task(limited(p, n)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"mean": statistics.fmean(s) * 1e3, "p50": pick(0.5) * 1e3, "p99": pick(0.99) * 1e3}


def summarize(args, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    return {
        "benchmark": "bench_serving", "base_url": args.base_url, "model": args.model, "label": args.label,
        "dataset": args.dataset, "num_prompts": len(results), "completed": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "input_len": args.input_len if args.dataset == "random" else statistics.fmean(r.prompt_len for r in results),
        "output_len": args.output_len, "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.latency for r in ok]),
    }


def table(rows: list[dict]) -> str:
    head = ["label", "dataset", "conc", "rate", "done", "out tok/s", "req/s", "TTFT mean/p50/p99 ms",
            "TPOT mean/p50/p99 ms", "ITL mean/p50/p99 ms"]
    fmt = lambda d: "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("mean", "p50", "p99"))  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        lines.append("| " + " | ".join(map(str, [
            s["label"], s["dataset"], s["max_concurrency"], s["request_rate"], f"{s['completed']}/{s['num_prompts']}",
            f"{s['output_tokens_per_s']:.0f}", f"{s['requests_per_s']:.2f}", fmt(s["ttft_ms"]), fmt(s["tpot_ms"]),
            fmt(s["itl_ms"])])) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    labels = [f"{r['label']}\n{r['dataset']} c={r['max_concurrency']}" for r in rows]
    axes[0].bar(labels, [r["output_tokens_per_s"] for r in rows])
    axes[0].set_title("output tok/s")
    for ax, key in zip(axes[1:], ("ttft_ms", "tpot_ms", "itl_ms")):
        x = range(len(rows))
        for off, q in ((-0.2, "p50"), (0.2, "p99")):
            ax.bar([i + off for i in x], [r[key][q] or 0 for r in rows], width=0.4, label=q)
        ax.set_xticks(list(x), labels)
        ax.set_title(key.replace("_ms", " (ms)"))
        ax.legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def add_args(ap: argparse.ArgumentParser, *, server: bool = True) -> None:
    """The workload's flags; ``server=False`` (an in-process driver): the server's model name is not needed."""
    if server:
        ap.add_argument("--model", required=True, help="the model name the server expects")
        ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset", choices=("random", "gsm8k"), default="random")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--vocab-size", type=int, default=32000, help="random prompts draw ids below this")
    ap.add_argument("--min-token-id", type=int, default=10, help="and from this (skip special tokens)")
    ap.add_argument("--gsm8k-tokens", default=str(GSM8K_TOKENS))
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: at once)")
    ap.add_argument("--warmup", type=int, default=2, help="short requests sent first (prompts of their own), not measured")
    ap.add_argument("--first-question", type=int, default=0, help="GSM8K: the first question used")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="server")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_args(ap)
    ap.add_argument("--out", default=None, help="JSON path (the table goes to stdout, the PNG beside the JSON)")
    args = ap.parse_args(argv)
    results, wall = asyncio.run(run(args))
    s = summarize(args, results, wall)
    print(table([s]))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"summary": s, "requests": [asdict(r) for r in results]}, indent=1))
        plot([s], out.with_suffix(".png"))
    return 0 if s["completed"] == s["num_prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
