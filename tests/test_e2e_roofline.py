"""benchmarks/e2e.py's shapes and the roofline (attnzoo.roofline), on CPU: the reduced DeepSeek-V3.2 shape, and NSA
layers counted at their top-k selection (plus the indexer keys once selection drops tokens)."""
import attnzoo
from attnzoo.roofline import balanced_seconds, model_profile, roofline_seconds, step_kinds
from test_nsa import COMMON, INDEXER


def test_dsv32_shape_is_dsv3_with_the_indexer(e2e):
    config, fields = e2e.make_config("dsv32", 4)
    v3, _ = e2e.make_config("dsv3", 4)
    assert config.architectures == ["DeepseekV32ForCausalLM"] and config.num_hidden_layers == 4
    assert (config.index_topk, config.index_head_dim, config.index_n_heads) == (2048, 128, 64)
    assert {k: v for k, v in fields.items() if not k.startswith("index_")} == {**e2e.DSV3, "num_hidden_layers": 4}
    assert config.hidden_size == v3.hidden_size and config.n_routed_experts == v3.n_routed_experts


def test_nsa_roofline_reads_the_selected_tokens_and_the_indexer_keys():
    from transformers import DeepseekV32Config

    config = DeepseekV32Config(**COMMON, **INDEXER)
    config.architectures = ["DeepseekV32ForCausalLM"]
    llm = attnzoo.load_model(config, load_format="random", device="cpu", dtype="bfloat16", backend="torch")
    prof = model_profile(llm)
    layer = prof["layers"][0]
    # MLA entry (latent 32 + rope 8) and indexer key (16), bf16; 8 indexer heads of 16
    assert (layer["kv_bytes"], layer["index_bytes"], layer["topk"]) == (80, 32, 6)
    assert layer["index_flops_per_pair"] == 2 * 8 * 16
    one = {**prof, "dense_bytes": 0, "expert_bytes": 0, "dense_params": 0, "expert_params": 0, "layers": [layer]}
    bytes_only = {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": float("inf")}

    def step(reqs, ctx):
        return {"num_reqs": reqs, "new_tokens": reqs, "kv_tokens": reqs * ctx, "shared_prefix_len": 0,
                "attn_pairs": reqs * ctx}

    # contexts within top-k: every token is selected, no indexer pass
    assert roofline_seconds([step(2, 5)], one, bytes_only) == 80 * 2 * 5
    # beyond it: top-k entries per request, and every cached token's indexer key
    assert roofline_seconds([step(2, 50)], one, bytes_only) == 80 * 2 * 6 + 32 * 2 * 50


def test_serial_roofline_adds_the_attention_to_compute_bound_gemms():
    """A large decode batch: its GEMMs are compute-bound, its attention reads KV. The roofline takes the larger
    of all bytes and all FLOPs; the serial one adds each part at its own bound."""
    prof = {"num_experts": 0, "top_k": 0, "expert_bytes": 0, "expert_params": 0, "dense_bytes": 1.0,
            "dense_params": 10.0, "layers": [{"window": None, "kv_bytes": 2.0, "flops_per_pair": 0.0}]}
    limits = {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": 1.0}
    step = {"num_reqs": 4, "new_tokens": 4, "kv_tokens": 4 * 3, "shared_prefix_len": 0, "attn_pairs": 4 * 3}
    # weights: 1 byte, 2 x 10 x 4 = 80 FLOPs; KV: 2 x 12 = 24 bytes, no attention FLOPs
    assert roofline_seconds([step], prof, limits) == max(1 + 24, 80)
    assert roofline_seconds([step], prof, limits, serial=True) == max(1, 80) + 24


def test_balanced_bound_spreads_the_prompts_over_the_decode_steps():
    """A prompt step (compute-bound) then ten decode steps of one row (bandwidth-bound) cost the sum of their own
    bounds; the same work spread over the fewest steps that can emit the output tokens reads the weights once a
    step and overlaps the prompt's FLOPs with the decode rows' KV reads."""
    prof = {"num_experts": 0, "top_k": 0, "expert_bytes": 0, "expert_params": 0, "dense_bytes": 10.0,
            "dense_params": 1.0, "layers": [{"window": None, "kv_bytes": 1.0, "flops_per_pair": 0.0}]}
    limits = {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": 1.0}

    def step(new, kv):
        return {"num_reqs": 1, "new_tokens": new, "kv_tokens": kv, "shared_prefix_len": 0, "attn_pairs": new * kv}

    steps = [step(100, 0)] + [step(1, 100 + i) for i in range(10)]
    kv = sum(range(100, 110))  # 1045 bytes of KV; 2 FLOPs a token: 220
    assert roofline_seconds(steps, prof, limits) == max(10, 200) + 10 * 10 + kv
    # ten tokens at ten rows a step: one step reads the weights once, the FLOPs hide under the bytes
    assert balanced_seconds(steps, prof, limits, output_tokens=10, rows=10) == max(10 + kv, 220)
    # one row a step: ten steps, ten weight reads
    assert balanced_seconds(steps, prof, limits, output_tokens=10, rows=1) == max(100 + kv, 220)
    fast_memory = {"copy_bytes_per_s": 1e6, "matmul_flops_per_s": 1.0}  # compute-bound: the FLOPs alone
    assert balanced_seconds(steps, prof, fast_memory, output_tokens=10, rows=10) == 220


def test_step_kinds_split_wall_and_roofline_by_decode_and_extend():
    """A step's wall runs from the previous step's tokens reaching the host (the first: from the start);
    decode steps (one new token per request) and extend steps are summed apart, each with its roofline."""
    prof = {"num_experts": 0, "top_k": 0, "expert_bytes": 0, "expert_params": 0, "dense_bytes": 10.0,
            "dense_params": 0, "layers": []}
    limits = {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": float("inf")}  # a step's roofline: 10 s of weights

    def step(reqs, new, t):
        return {"num_reqs": reqs, "new_tokens": new, "kv_tokens": 0, "shared_prefix_len": 0, "attn_pairs": 0, "t": t}

    steps = [step(2, 40, 101.0), step(2, 2, 101.5), step(2, 2, 101.75), step(3, 9, 103.0)]
    got = step_kinds(steps, t0=100.0, prof=prof, limits=limits)
    assert got == {"decode_wall_s": 0.75, "decode_roofline_s": 20.0, "extend_wall_s": 1.0 + 1.25,
                   "extend_roofline_s": 20.0}


def test_qwen3_30b_a3b_shape_builds_on_the_meta_device(e2e):
    """The full-size shape builds (no memory): Qwen3-30B-A3B's 30.5B parameters, 3.3B active per token."""
    from attnzoo.models.registry import model_class

    config, fields = e2e.make_config("qwen3-30b-a3b", None)
    assert config.architectures == ["Qwen3MoeForCausalLM"] and fields["num_hidden_layers"] == 48
    model = model_class("Qwen3MoeForCausalLM").shapes_only(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    assert 30.0e9 < total < 31.0e9 and 3.0e9 < active < 3.6e9, (total, active)
    attn = model.attention_layers()
    assert len(attn) == 48 and (attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim) == (32, 4, 128)


def test_full_warm_up_leaves_only_the_first_two_prompts_cached(e2e, tmp_path):
    """The pass over every prompt (behind a marker token) compiles the measured run's shapes, and the backends'
    warm-up what only captured steps run; then the pass's pages leave the prefix cache, and the measured run starts
    with what the two-prompt warm-up cached, as before."""
    from helpers import random_prompts, save_checkpoint
    from test_llama import tiny_llama

    save_checkpoint(tiny_llama(), tmp_path)
    llm = attnzoo.load_model(tmp_path, backend="torch", dtype="float32", page_size=4)
    prefix = random_prompts(160, [22], seed=1)[0]
    prompts = [prefix + q for q in random_prompts(160, [3, 5, 7, 9, 11], seed=2)]
    cascade = llm.engine.cascade_min_saved_tokens, llm.engine.runner.cascade_graph_min_saved_tokens
    backends_warmed, warm = [], llm.engine.warm_up_backends
    llm.engine.warm_up_backends = lambda: backends_warmed.append(1) or warm()
    res = e2e.warm_up(llm, prompts, full=True)
    assert res["first_decode_logits_finite"] and res["full_warm_up_s"] >= 0
    assert backends_warmed == [1], "the backends' own warm-up (paths only captured steps take), as a server's"
    assert (llm.engine.cascade_min_saved_tokens, llm.engine.runner.cascade_graph_min_saved_tokens) == cascade
    cache = llm.engine.pages.prefix_cache
    # the shared prefix's 5 full pages and the 6th page of each of the first two prompts (25 and 27 tokens):
    # none of the marker pass's (1 + 22 + ... tokens: 6 more pages a prompt)
    assert cache.evictable() == 7


def test_a_one_prompt_warm_up_also_runs_the_cached_prefix_extend_the_measured_run_takes(e2e, tmp_path):
    """With one prompt, the measured run extends only the prompt's tail past its cached pages: warm-up runs that
    extend too, so its shapes compile before the measured first token."""
    from helpers import random_prompts, save_checkpoint
    from test_llama import tiny_llama

    save_checkpoint(tiny_llama(), tmp_path)
    llm = attnzoo.load_model(tmp_path, backend="torch", dtype="float32", page_size=4)
    prompts = random_prompts(160, [22], seed=1)
    cache, calls = llm.engine.pages.prefix_cache, []
    generate = llm.generate
    llm.generate = lambda p, **kw: calls.append((p, cache.evictable())) or generate(p, **kw)
    e2e.warm_up(llm, prompts, full=True)
    assert [p for p, _ in calls] == [prompts, prompts]
    assert calls[0][1] == 0 and calls[1][1] == 5  # the second finds the prompt's 5 full pages cached
