"""Mixture-of-experts: routing, stacked expert weights, a fused Triton path and the per-expert oracle, one idea
per module: ``routing`` (router logits -> weights and expert ids), ``tiles`` (the grouped GEMMs' tiles and the
per-GPU tuned tables), ``fused`` (the Triton path), ``reference`` (the oracle), ``layer`` (``FusedMoE`` and its
checkpoint loading). The names below are importable from ``attnzoo.layers.moe`` itself.

``select_experts`` turns router logits into (weights, expert ids): DeepSeek's softmax or sigmoid scores,
group-limited choice, top-k, renormalisation and scaling, one Triton launch per layer on a GPU; ``route`` takes the
router's input and weight instead, and at decode's few tokens computes the logits in the same launch.

``FusedMoE`` holds a contiguous range of a layer's routed experts (all of them, or one expert-parallel
rank's share; ``holds(e)`` is the one answer to which rank owns an expert) as two stacked tensors,
``w13`` [E_local, 2I, H] (gate rows then up rows) and ``w2`` [E_local, H, I], and takes the routing the
model computed: ``topk_ids`` [T, k] (global expert ids) and ``topk_weights`` [T, k] float32. Each
token's output is sum_j w_j * down(act(gate(x)) * up(x)) over its chosen experts held here; experts
held elsewhere contribute zero (the expert-parallel caller all-reduces). gpt-oss adds per-expert
biases (``bias=True``: ``w13_bias`` [E_local, 2I], ``w2_bias`` [E_local, H], the down one before the
routing weight, in the GEMMs' epilogues on the fused path) and its clamped SwiGLU (``act="swiglu_clamped"``);
its checkpoint stacks gate and up interleaved and transposed (``stacked_layout="interleaved_t"``).

On CUDA it runs ``fused_moe``, in the style of vLLM's / SGLang's fused_moe:
  1. ``moe_align_block_size`` sorts the T*k (token, slot) assignments by expert and pads each expert's
     run to a multiple of BLOCK_M (one small Triton kernel, no host sync).
  2. One grouped GEMM launch computes every block's gate_up rows (each block reads one expert's weights),
     an elementwise kernel applies act(gate) * up, and a second grouped GEMM launch computes down and
     multiplies each row by its routing weight; one kernel sums the k rows of a token (plus the shared
     experts' output when given).
Every buffer and grid is sized for the worst case of the shape (T, k, E_local), never for the routing:
blocks past the padded total exit at once. A captured CUDA graph therefore replays any routing, and
only the experts actually chosen are read, instead of every expert running on every token. The tiles
come from ``tile_config``: a table tuned per GPU (``moe_configs/``, written by ``benchmarks/moe.py
--sweep``), else ``default_config``.

With ``quant="fp8"`` the weights are float8_e4m3fn with float32 ``w13_scale_inv`` / ``w2_scale_inv``,
one multiplier per [128, 128] block (DeepSeek-V3's ``weight_block_size``), and the GEMMs are w8a8 as in
DeepSeek's reference: activations quantized per token per 128-channel group by ``fp8.act_quant`` (the
one implementation the FP8 linear layers use; power-of-two scales under the checkpoint's ``scale_fmt:
"ue8m0"``), the float32 accumulator scaled per block. The gate and up halves of ``w13`` keep their own
scale blocks, so ``w13_scale_inv`` is [E, 2 * ceil(I/128), ceil(H/128)] (= ceil(2I/128) rows when 128
divides I, as in vLLM's layout) and I need not be a multiple of 128.

With ``quant="mxfp4"`` (gpt-oss's checkpoints kept as stored) the weights are uint8 [E, N, K/2], two e2m1
codes per byte, with uint8 E8M0 ``w13_scale_inv`` / ``w2_scale_inv`` [E, N, K/32] (``layers.mxfp4``); the
grouped GEMM decodes a K tile in registers and multiplies in the activation dtype (w4a16).

On CPU ``moe_reference`` (a loop over the experts that have tokens, float32 accumulation, FP8 weights
dequantized, activations rounded as the kernels round them) computes the same sum: it is the oracle the
fused path is tested against. The Triton kernels also run on CPU under ``TRITON_INTERPRET=1`` (inside
``fused.use("triton")``, as every fused op of a layer) for tests.
"""
from attnzoo.layers.moe.fused import (
    MAX_CHUNK_TOKENS, _grouped_gemm, align_one_token, fused_moe, moe_align_block_size, padded_slots,
)
from attnzoo.layers.moe.layer import STACKED_LAYOUTS, FusedMoE, build_experts_as
from attnzoo.layers.moe.reference import (
    ACTIVATIONS, FP8, MXFP4, SWIGLU_ALPHA, SWIGLU_LIMIT, dequantize_block_fp8, moe_reference, scale_rows,
)
from attnzoo.layers.moe.routing import GROUP_SCORES, ROUTER_ROWS, arrivals_counter, route, select_experts, select_experts_reference
from attnzoo.layers.moe.tiles import (
    TILE_TABLES, WEIGHT_FORMATS, MoEConfig, check_config, default_config, gpu_slug, pick_config, read_tile_table, tile_config, tile_key,
    weight_format, write_tile_table,
)

__all__ = [
    "ACTIVATIONS", "FP8", "GROUP_SCORES", "MXFP4", "MAX_CHUNK_TOKENS", "ROUTER_ROWS", "STACKED_LAYOUTS", "SWIGLU_ALPHA", "SWIGLU_LIMIT",
    "TILE_TABLES", "FusedMoE", "MoEConfig", "_grouped_gemm", "align_one_token", "arrivals_counter", "build_experts_as", "check_config",
    "default_config", "dequantize_block_fp8", "fused_moe", "gpu_slug", "moe_align_block_size", "moe_reference",
    "padded_slots", "pick_config", "read_tile_table", "route", "scale_rows", "select_experts", "select_experts_reference",
    "tile_config", "tile_key", "weight_format", "write_tile_table", "WEIGHT_FORMATS",
]
