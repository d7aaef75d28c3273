"""The roofline the end-to-end benchmarks set a run against: per step, the larger of the bytes it must move over
the device's copy bandwidth and its FLOPs over the device's matmul rate, from a loaded model's weight and KV sizes
(``model_profile``) and the engine's step log. Kept in the package, not in benchmarks/, so tests can check it."""
from __future__ import annotations

import torch


# The ceilings are the best of several medians: on an idle GPU the first ones can come in low (clocks still
# rising), and a low ceiling inflates the roofline fraction of a run no faster than another.
REPEATS = 5


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second (GB/s)."""
    from attnzoo.tune import time_ms

    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = min(time_ms(lambda: dst.copy_(src), device, warmup=5, iters=30) for _ in range(REPEATS))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device, n: int = 8192) -> float:
    """bf16 n x n x n matmul rate on random data (TFLOP/s), the prefill ceiling."""
    from attnzoo.tune import time_ms

    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flush = torch.empty(1, dtype=torch.uint8, device=device)
    ms = min(time_ms(lambda: a @ b, device, warmup=3, iters=10, flush=flush) for _ in range(REPEATS))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def device_limits(device="cuda") -> dict:
    """Measured device-to-device copy bandwidth (read + write bytes) and bf16 matmul rate."""
    return {"copy_bytes_per_s": copy_bandwidth(device) * 1e9, "matmul_flops_per_s": matmul_tflops(device) * 1e12}


def model_profile(llm) -> dict:
    """What the roofline needs from a loaded model: dense and per-expert weight bytes, attention layers."""
    size = {"dense_bytes": 0, "expert_bytes": 0, "dense_params": 0, "expert_params": 0}
    for name, p in llm.model.named_parameters():
        part = "expert" if ".experts." in name else "dense"
        size[f"{part}_bytes"] += p.numel() * p.element_size()
        if not name.endswith("scale_inv"):
            size[f"{part}_params"] += p.numel()
    cfg = getattr(llm.config, "text_config", None) or llm.config
    num_experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or 0
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts", None) or 0
    layers = []
    for a in llm.model.attention_layers():
        elt = llm.pool.dtype.itemsize
        spec = a.kv_cache_spec()
        kv = 0 if spec.shared_from is not None else spec.values_per_token() * elt
        if a.kind == "dsv4":  # compressed attention: what each layer kind reads per step (roofline_seconds)
            layers.append({"window": a.sliding_window, "kv_bytes": a.head_dim * elt,
                           "flops_per_pair": 2 * a.num_heads * 2 * a.head_dim, "rate": a.compress_rate,
                           "compressed_bytes": a.head_dim * elt, "csa_topk": a.index_topk,
                           "index_bytes": a.index_dim * elt, "index_flops_per_pair": 2 * a.index_n_heads * a.index_dim,
                           "state_bytes": a.state_dim * elt * (2 if a.overlap else 1)})
            continue
        layers.append({"window": a.sliding_window, "kv_bytes": kv,
                       "flops_per_pair": 2 * a.num_heads * (a.head_dim + a.v_head_dim)})
        if a.sparse:  # NSA: the selected tokens' MLA entries, in the layout the decode backend reads
            layout = llm.engine.decode_backend.mla_kv_layout
            layers[-1].update(kv_bytes=layout.row_bytes(a.v_head_dim, a.head_dim - a.v_head_dim, llm.pool.dtype),
                              topk=cfg.index_topk, index_bytes=a.index_head_dim * elt,
                              index_flops_per_pair=2 * cfg.index_n_heads * a.index_head_dim)
    return {**size, "num_experts": num_experts if size["expert_params"] else 0, "top_k": top_k, "layers": layers}


def roofline_seconds(steps: list[dict], prof: dict, limits: dict, shared_once: bool = True,
                     serial: bool = False) -> float:
    """Per step: max(bytes moved / copy bandwidth, FLOPs / matmul rate), summed.

    ``serial``: per step, the weights' part (their bytes against the projections' FLOPs) and the attention's
    part (KV bytes against attention FLOPs) each at its own bound, added: the best that kernels running one
    after the other can reach, where a step whose GEMMs are compute-bound cannot hide its KV reads under them.

    Bytes: dense weights, the experts the step's tokens can touch (expected distinct experts of
    ``tokens x top_k`` uniform picks), and the KV each layer reads (sliding layers: at most the window per
    request, from the step's mean context; NSA layers: the MLA entries of at most ``topk`` selected tokens
    per request, plus every cached token's indexer key when the mean context exceeds ``topk``, below which
    selection keeps every token and the indexer need not run; compressed (DeepSeek-V4) layers: the raw window,
    then one entry per ``rate`` tokens of context, all of them (HCA) or the indexer's ``csa_topk`` (CSA, which
    also reads every entry's indexer key), plus each new token's compressor state once (twice with overlap)
    when its block is pooled). ``shared_once``: a cascade step reads its
    shared prefix once, and a sliding layer the part of it inside every request's window once (token-exact,
    a lower bound on the page-granular split the backends make). FLOPs: 2 x active weights per token
    (dense + top_k experts) + attention over the step's token pairs (NSA: over the selected ones, plus the
    indexer's scores over every pair).
    """
    bw, rate = limits["copy_bytes_per_s"], limits["matmul_flops_per_s"]
    total = 0.0
    for s in steps:
        weight_bytes, kv_bytes, gemm_flops, attn_flops = step_cost(s, prof, shared_once)
        if serial:
            total += max(weight_bytes / bw, gemm_flops / rate) + max(kv_bytes / bw, attn_flops / rate)
        else:
            total += max((weight_bytes + kv_bytes) / bw, (gemm_flops + attn_flops) / rate)
    return total


def weight_bytes_at(prof: dict, tokens: float) -> float:
    """The weights a step of ``tokens`` new tokens reads: the dense ones and the experts its tokens can touch
    (expected distinct experts of ``tokens x top_k`` uniform picks)."""
    E, k = prof["num_experts"], prof["top_k"]
    touched = E * (1 - (1 - k / E) ** tokens) if E else 0
    return prof["dense_bytes"] + prof["expert_bytes"] / max(E, 1) * touched


def step_cost(s: dict, prof: dict, shared_once: bool = True) -> tuple[float, float, float, float]:
    """One logged step's (weight bytes, KV bytes, GEMM FLOPs, attention FLOPs), as ``roofline_seconds`` counts them."""
    E, k = prof["num_experts"], prof["top_k"]
    active_params = prof["dense_params"] + (prof["expert_params"] / E * k if E else 0)
    n = s["new_tokens"]
    weight_bytes = weight_bytes_at(prof, n)
    mean_ctx = s["kv_tokens"] / max(s["num_reqs"], 1)
    shared = s["shared_prefix_len"] if shared_once else 0
    saved = shared * (s["num_reqs"] - 1)
    kv_bytes = 0.0
    attn_flops = 0.0
    for layer in prof["layers"]:
        if layer["window"]:
            # Windowed cascade: the prefix tokens inside every request's window (those after the longest
            # request's window start) are read once; step logs without max_seq_len count none.
            seen = max(0, shared - max(0, s.get("max_seq_len", 1 << 62) - layer["window"]))
            kv_bytes += layer["kv_bytes"] * (s["num_reqs"] * min(mean_ctx, layer["window"])
                                             - seen * (s["num_reqs"] - 1))
            attn_flops += layer["flops_per_pair"] * n * min(mean_ctx, layer["window"])
        elif layer.get("topk"):  # NSA: at most topk selected tokens per query
            kv_bytes += layer["kv_bytes"] * s["num_reqs"] * min(mean_ctx, layer["topk"])
            attn_flops += layer["flops_per_pair"] * n * min(mean_ctx, layer["topk"])
        else:
            kv_bytes += layer["kv_bytes"] * (s["kv_tokens"] - saved)
            attn_flops += layer["flops_per_pair"] * s["attn_pairs"]
        if layer.get("rate"):  # compressed entries: HCA every one, CSA the indexer's top-k plus every index key
            entries = mean_ctx / layer["rate"]
            read = min(entries, layer["csa_topk"]) if layer["csa_topk"] else entries
            kv_bytes += layer["compressed_bytes"] * s["num_reqs"] * read + layer["state_bytes"] * n
            attn_flops += layer["flops_per_pair"] * n * read
            if layer["csa_topk"]:
                kv_bytes += layer["index_bytes"] * s["num_reqs"] * entries
                attn_flops += layer["index_flops_per_pair"] * n * entries
        if layer.get("topk") and mean_ctx > layer["topk"]:
            kv_bytes += layer["index_bytes"] * s["kv_tokens"]
            attn_flops += layer["index_flops_per_pair"] * s["attn_pairs"]
    return weight_bytes, kv_bytes, 2 * active_params * n, attn_flops


def balanced_seconds(steps: list[dict], prof: dict, limits: dict, *, output_tokens: int, rows: int) -> float:
    """A bound for the same work under the best chunked-prefill schedule: the run's new tokens, KV reads and
    FLOPs (``step_cost`` of its logged steps) spread evenly over the fewest steps that emit ``output_tokens`` at
    ``rows`` sampled rows a step, each step reading the weights once and at max(bytes, FLOPs). Where a schedule
    runs compute-bound prompt steps and bandwidth-bound decode steps apart (``roofline_seconds`` of its own
    steps), a balanced one hides the decode rows' reads under the prompts' GEMMs: this is how far that goes."""
    n_steps = max(1, -(-output_tokens // max(rows, 1)))
    costs = [step_cost(s, prof) for s in steps]
    new_tokens = sum(s["new_tokens"] for s in steps) / n_steps
    kv_bytes = sum(c[1] for c in costs)
    flops = sum(c[2] + c[3] for c in costs)
    bw, rate = limits["copy_bytes_per_s"], limits["matmul_flops_per_s"]
    return max(n_steps * weight_bytes_at(prof, new_tokens) / bw + kv_bytes / bw, flops / rate)


def step_kinds(steps: list[dict], *, t0: float, prof: dict, limits: dict) -> dict:
    """Wall and roofline seconds of the decode steps and of the extend (prompt) steps apart. A step's wall is
    the time from the previous step's tokens reaching the host to its own (the first: from ``t0``): with the
    next step launched before the host reads a step's tokens, that is the GPU's time per step once the
    pipeline is full."""
    out = {}
    for kind, decode in (("decode", True), ("extend", False)):
        mine = [(s, s["t"] - (steps[i - 1]["t"] if i else t0)) for i, s in enumerate(steps)
                if (s["new_tokens"] == s["num_reqs"]) == decode]
        out[f"{kind}_wall_s"] = sum(d for _, d in mine)
        out[f"{kind}_roofline_s"] = roofline_seconds([s for s, _ in mine], prof, limits)
    return out
