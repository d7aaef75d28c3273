"""Random-weight models (``load_format="random"``) in DeepSeek-V3's FP8 block format: FP8 codes and block
factors drawn directly, never through a float copy of an expert stack or of an expert; the spread of
the float model's init; deterministic per seed; finite logits; under tensor parallelism each rank
builds its own shard and its own experts only."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config

import attnzoo
from attnzoo.layers.fp8 import FP8, Fp8Linear
from attnzoo.layers.moe import FusedMoE
from attnzoo.layers.parallel import TPContext
from attnzoo.models.weights import plan_weights
from attnzoo.models.registry import model_class
from test_fp8 import QUANT, TINY_V3, _needs_fp8_gpu
from test_tensor_parallel import FP8_ALIGNED

E, H, I = 8, 200, 72  # routed experts, hidden, expert intermediate (partial 128-blocks on both sides)
# Two shared experts, so that no dense layer has an expert's shape ([2I, H], [H, I]) by coincidence.
CONFIG = dict(TINY_V3, n_routed_experts=E, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
              quantization_config=QUANT, architectures=["DeepseekV3ForCausalLM"])
# Every shape a float copy of the experts (a layer's stack, one expert, one half of w13) would have.
EXPERT_SHAPES = {(E, 2 * I, H), (E, H, I), (2 * I, H), (H, I), (I, H)}


class _FloatAllocations(TorchDispatchMode):
    """Records (shape, dtype) of every floating-point tensor any torch op returns (FP8 codes and meta
    tensors excluded)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # Meta tensors hold no memory: the policy builds the model on the meta device for its profile.
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != FP8 and not t.is_meta:
                self.seen.add((tuple(t.shape), t.dtype))
        return out


def _load(seed: int = 0, **kw):
    cfg = DeepseekV3Config(**{**CONFIG, **kw})
    return attnzoo.load_model(cfg, load_format="random", backend="torch", device="cpu", fp8_weights="fp8",
                              kv_cache_tokens=128, page_size=4, seed=seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_random_fp8_v3_is_built_in_fp8_without_a_float_expert_copy():
    with _FloatAllocations() as mode:
        llm = _load()
    floats = {shape for shape, _ in mode.seen}
    assert not floats & EXPERT_SHAPES, f"float tensors of an expert's shape were made: {floats & EXPERT_SHAPES}"
    moes = [m for m in llm.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.w13.dtype == m.w2.dtype == FP8 and m.w13_scale_inv.dtype == torch.float32 for m in moes)
    linears = [m for m in llm.model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 2 * 3 + 2 + 2  # per layer q_a+kv_a, q_b, o; dense gate_up, down; shared gate_up, down
    assert all(m.weight.dtype == FP8 for m in linears)
    # The float model's spread: experts init_std (config.initializer_range), linear layers nn.Linear's.
    factors = moes[0].w13_scale_inv
    assert torch.equal(factors, factors.flatten()[0].expand_as(factors))  # one factor for every block
    w13 = moes[0].w13.float() * factors.flatten()[0]
    assert abs(float(w13.std()) / 0.02 - 1) < 0.02
    down = llm.model.model.layers[0].mlp.down_proj
    assert abs(float(down.dequantized(torch.float32).std()) * (3 * down.in_features) ** 0.5 - 1) < 0.02


def test_random_fp8_v3_is_deterministic_per_seed_and_its_logits_are_finite():
    a, b, c = _load(seed=5), _load(seed=5), _load(seed=6)
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(_bits(pa[n]), _bits(pb[n])) for n in pa)
    codes = "model.layers.1.mlp.experts.w13"
    assert not torch.equal(_bits(pa[codes]), _bits(pc[codes]))
    outs = a.generate([[5, 6, 7, 8], [9, 10]], max_new_tokens=3, ignore_eos=True, return_logits=True)
    logits = torch.cat([o.logits for o in outs])
    assert torch.isfinite(logits).all() and logits.std() > 0.01
    again = b.generate([[5, 6, 7, 8], [9, 10]], max_new_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_random_fp8_v3_logits_stay_finite_through_61_layers():
    """V3's depth (3 dense + 58 MoE layers): the residual stream neither overflows nor vanishes."""
    llm = _load(num_hidden_layers=61, first_k_dense_replace=3)
    rms = []
    for layer in llm.model.model.layers:
        layer.register_forward_hook(lambda m, args, out: rms.append(float(out[1].float().pow(2).mean().sqrt())))
    out = llm.generate([[3, 4, 5, 6, 7]], max_new_tokens=2, ignore_eos=True, return_logits=True)[0]
    assert torch.isfinite(out.logits).all() and out.logits.std() > 0.01
    assert 0.1 < min(rms) and max(rms) < 100, (min(rms), max(rms))


def _rank(rank: int, world: int):
    cfg = DeepseekV3Config(**{**CONFIG, **FP8_ALIGNED})  # split layers cut whole 128-blocks: they stay FP8
    cls = model_class("DeepseekV3ForCausalLM")
    plan = plan_weights(cfg, cls, device=torch.device("cpu"), dtype=torch.float32, mode="fp8", checkpoint_names=None)
    torch.manual_seed(0)
    return plan.build(functools.partial(cls, tp=TPContext(rank=rank, world_size=world)), cfg)


def test_each_tensor_parallel_rank_builds_its_own_shard_and_experts_only():
    whole, ranks = _rank(0, 1), [_rank(r, 2) for r in range(2)]
    full = dict(whole.named_parameters())
    for r, model in enumerate(ranks):
        moe = model.model.layers[1].mlp.experts
        assert moe.share == range(r * E // 2, (r + 1) * E // 2) and moe.w13.shape == (E // 2, 2 * 64, H)
        params = dict(model.named_parameters())
        attn = "model.layers.1.self_attn."
        assert params[attn + "q_b_proj.weight"].shape[0] == full[attn + "q_b_proj.weight"].shape[0] // 2
        assert params[attn + "o_proj.weight"].shape[1] == full[attn + "o_proj.weight"].shape[1] // 2
        assert params["lm_head.weight"].shape[0] == full["lm_head.weight"].shape[0] // 2
        assert all(params[n].dtype == full[n].dtype for n in full if n in params)
        held = sum(p.numel() * p.element_size() for p in params.values())
        assert held < 0.6 * sum(p.numel() * p.element_size() for p in full.values())
    # What every rank computes whole (the latents, the router, the norms) is drawn alike on each.
    p0, p1 = (dict(m.named_parameters()) for m in ranks)
    for name in ("model.layers.1.self_attn.q_kv_a_proj.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.self_attn.kv_a_layernorm.weight"):
        assert torch.equal(_bits(p0[name]), _bits(p1[name])), name


def test_random_fp8_v3_at_tp2_over_gloo():
    """The spawn route (gloo, two processes): each rank builds its half; tokens come out, logits finite."""
    llm = attnzoo.load_model(DeepseekV3Config(**{**CONFIG, **FP8_ALIGNED}), load_format="random", backend="torch",
                             device="cpu", fp8_weights="fp8", kv_cache_tokens=128, page_size=4, tensor_parallel_size=2)
    try:
        moe = llm.model.model.layers[1].mlp.experts
        assert moe.share == range(0, E // 2) and moe.w13.dtype == FP8
        out = llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True, return_logits=True)[0]
        assert len(out.token_ids) == 3 and torch.isfinite(out.logits).all()
        info = llm.info()
        assert "split_blocks" not in info["weights"] and info["weights"]["fp8_shards"].startswith("per rank")
        assert set(info["load_timings"]) == {"build_s", "weights_s", "kv_cache_s"}
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_random_fp8_v3_is_drawn_on_the_gpu_deterministic_and_finite():
    """On the GPU: codes drawn there (CUDA RNG), the same per seed, the fused FP8 MoE and FP8 GEMMs give
    finite logits with CUDA graphs on, and each load phase is timed."""
    _needs_fp8_gpu()
    kw = dict(load_format="random", backend="triton", device="cuda", dtype="bfloat16", kv_cache_tokens=4096,
              max_running=8)
    a, b = (attnzoo.load_model(DeepseekV3Config(**CONFIG), seed=3, **kw) for _ in range(2))
    moe = a.model.model.layers[1].mlp.experts
    assert moe.w13.is_cuda and moe.w13.dtype == FP8
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(_bits(pa[n]), _bits(pb[n])) for n in pa)
    out = a.generate([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True, return_logits=True)[0]
    assert torch.isfinite(out.logits).all() and a.engine.graphs is not None
    assert set(a.info()["load_timings"]) == {"build_s", "weights_s", "kv_cache_s", "cuda_graphs_s"}
