"""Triton kernels of the fused MoE (``attnzoo/layers/moe/fused.py``, which imports this module on first use so
that importing a model file never imports triton; on CPU the interpreter must be chosen first).

* ``align_kernel``: the expert sort and padding of ``moe_align_block_size`` (one launch).
* ``gemm_kernel``: one projection of every expert's padded row blocks in one launch (bf16/fp32 weights, FP8
  block-scaled w8a8, or MXFP4 weights decoded in the K loop: w4a16); with GATED (unquantized weights), gate_up
  ending in ``act_kernel``'s activation, so the [T*k, 2I] intermediate is never written.
* ``sum_kernel``: each token's k weighted expert rows summed in float32 (plus the shared experts'
  output), stored in the model dtype.
* ``route_kernel``: a router's scoring, group-limited top-k, renormalisation and scaling per token;
  ``router_kernel`` the same after the router's float32 GEMV, in one launch (decode's few tokens).
* ``act_kernel``: act(gate) * up, optionally quantized to FP8 per 128-channel group (by
  ``fp8_kernels.quant_groups``, the code ``fp8.act_quant`` runs).
"""
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import last_arrival, prior_done
from attnzoo.layers.fp8_kernels import quant_groups


# Sizes that change with the batch are not specialized on (divisibility by 16, == 1): one compiled
# kernel per tile config serves every batch and both projections (and the tile sweep compiles less).
@triton.jit(do_not_specialize=["n"])
def align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, n, expert_start, num_local,
                 BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    # One program per local expert. Each counts every expert's assignments itself (a histogram of the
    # ids: no separate count launch, no zeroed buffer); its padded run starts after the padded runs of
    # experts < e; its assignments are written there in flat order (deterministic), then sentinel rows
    # (n) pad it. Ids of other ranks' experts fall in bin BINS - 1 (>= num_local), which is ignored.
    prior_done(PDL)
    e = tl.program_id(0)
    cnt = tl.zeros([BINS], dtype=tl.int32)
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32) - expert_start
        ok = (offs < n) & (ids >= 0) & (ids < num_local)
        cnt += tl.histogram(tl.where(ok, ids, BINS - 1), BINS).to(tl.int32)
    offs_e = tl.arange(0, BINS)
    cnt = tl.where(offs_e < num_local, cnt, 0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0))
    my_cnt = tl.sum(tl.where(offs_e == e, cnt, 0))
    my_padded = tl.sum(tl.where(offs_e == e, padded, 0))
    if e == 0:
        tl.store(total_ptr, tl.sum(padded))
    seen = start
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32) - expert_start
        hit = (ids == e) & (offs < n)
        rank = tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + seen + rank, offs.to(tl.int32), mask=hit)
        seen += tl.sum(hit.to(tl.int32))
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + my_cnt + pad, tl.full([BLOCK_M], 0, tl.int32) + n,
             mask=pad < my_padded - my_cnt)
    first_block = start // BLOCK_M
    for b in range(0, my_padded // BLOCK_M, CHUNK):
        offs_b = b + tl.arange(0, CHUNK)
        tl.store(expert_ids_ptr + first_block + offs_b, tl.full([CHUNK], 0, tl.int32) + e,
                 mask=offs_b < my_padded // BLOCK_M)

@triton.jit
def _e2m1(code):
    # FP4 e2m1 code (int32, 0..15) -> float32: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa;
    # exponent 0 is subnormal (0 or 0.5). 4 * |value| is the integer 2m (subnormal) or (2 + m) << e.
    e = (code >> 1) & 3
    m = code & 1
    q = tl.where(e == 0, 2 * m, (2 + m) << e).to(tl.float32) * 0.25
    return tl.where((code & 8) != 0, -q, q)


@triton.jit
def _e8m0(s):
    # E8M0 scale byte (int32) -> 2^(s - 127) as float32 bits (exact, no exp2 approximation or flush);
    # s = 0 is the subnormal 2^-127.
    return tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def _at_most(x, hi):
    # torch.clamp's rule: NaN stays NaN (tl.minimum/maximum return the other operand)
    return tl.where(x != x, x, tl.minimum(x, hi))


@triton.jit
def _clamp(x, lo, hi):
    return _at_most(tl.where(x != x, x, tl.maximum(x, lo)), hi)


@triton.jit
def _dot(a, b, F32_OPERANDS: tl.constexpr, IEEE: tl.constexpr):
    if F32_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _gated_act(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP: tl.constexpr):
    # ACT 1 silu, 2 gelu-tanh, 3 gpt-oss's clamped SwiGLU; CLAMP > 0: DeepSeek-V4's clamps first
    if CLAMP > 0:
        gate = _at_most(gate, CLAMP)
        up = _clamp(up, -CLAMP, CLAMP)
    if ACT == 1:
        v = gate * tl.sigmoid(gate) * up
    elif ACT == 3:
        g = _at_most(gate, LIMIT)
        v = (_clamp(up, -LIMIT, LIMIT) + 1.0) * (g * tl.sigmoid(g * ALPHA))
    else:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        v = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0)) * up
    return v


@triton.jit(do_not_specialize=["num_valid", "num_m_blocks", "rows_per_a", "mul_weight", "stride_asm", "stride_bse",
                               "stride_bsn"])
def gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weights_ptr, bias_ptr,
                sorted_ptr, expert_ids_ptr, total_ptr,
                N, K, num_valid, num_m_blocks, split_n, rows_per_a, mul_weight,
                stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_biase,
                FP8: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
                F32_OPERANDS: tl.constexpr,
                GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                B_MXFP4: tl.constexpr = False, PDL: tl.constexpr = False, GATED: tl.constexpr = False,
                ACT: tl.constexpr = 1, ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0,
                CLAMP: tl.constexpr = 0.0):
    # C[row] = A[row // rows_per_a] @ B[expert(block)]^T for the rows of one padded M block; rows are
    # flat (token, slot) indices, A is x (rows_per_a = k) or the intermediate (rows_per_a = 1; a
    # runtime value so that one compiled kernel serves every top-k).
    # GATED (neither FP8 nor MXFP4): B's rows are N gate rows then N up rows, C [rows, N] = act(gate) * up.
    # IEEE: float32 models get no TF32 rounding. F32_OPERANDS (off the GPU): Triton's interpreter
    # multiplies the raw bits of bfloat16 tl.dot operands (see attention/kernels/common.py dot_args).
    prior_done(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_valid
    a_rows = (rows // rows_per_a).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    if FP8:
        a_s_ptrs = a_scale_ptr + a_rows * stride_asm
        s_rows = tl.where(offs_n < split_n, offs_n // GROUP_N,
                          (split_n + GROUP_N - 1) // GROUP_N + (offs_n - split_n) // GROUP_N)
        b_s_ptrs = b_scale_ptr + expert * stride_bse + s_rows * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED only
    if B_MXFP4:
        # B is packed bytes [E, N, K / 2] (two e2m1 codes per byte, the even k in the low nibble) with E8M0
        # scales [E, N, K / 32] (b_scale_ptr / stride_bs*). A K tile's bytes are read as [BLOCK_N, BLOCK_K / 2]
        # (contiguous along K, as A's rows are), decoded, and the nibbles interleaved back into K order.
        offs_j = tl.arange(0, BLOCK_K // 2)
        b_ptrs = b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_j[None, :] * stride_bk
        b_s_ptrs = (b_scale_ptr + expert * stride_bse + offs_n[:, None].to(tl.int64) * stride_bsn
                    + (offs_j // 16)[None, :] * stride_bsk)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            b_ok = n_ok[:, None] & (2 * offs_j < K - k0)[None, :]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            packed = tl.load(b_ptrs, mask=b_ok, other=0).to(tl.int32)
            scale = _e8m0(tl.load(b_s_ptrs, mask=b_ok, other=127).to(tl.int32))
            b = tl.trans(tl.interleave(_e2m1(packed & 0xF) * scale, _e2m1(packed >> 4) * scale)).to(a.dtype)
            acc += _dot(a, b, F32_OPERANDS, IEEE)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += (BLOCK_K // 2) * stride_bk
            b_s_ptrs += (BLOCK_K // 32) * stride_bsk
    else:
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            d = _dot(a, b, F32_OPERANDS, IEEE)
            if GATED:
                up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc_up += _dot(a, up, F32_OPERANDS, IEEE)
            if FP8:
                a_s = tl.load(a_s_ptrs + (k0 // GROUP_K) * stride_ask, mask=row_ok, other=0.0)
                b_s = tl.load(b_s_ptrs + (k0 // GROUP_K) * stride_bsk, mask=n_ok, other=0.0)
                acc += d * a_s[:, None] * b_s[None, :]
            else:
                acc += d
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:  # the expert's bias [N] (gpt-oss), before the routing weight
        bias_row = bias_ptr + expert * stride_biase
        acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:  # gate and up rounded to C's dtype first, as the two-launch path stores them
        dt = c_ptr.dtype.element_ty
        acc = _gated_act(acc.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), ACT, ALPHA, LIMIT, CLAMP)
    if mul_weight:  # the down projection: each row times its routing weight
        acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def act_kernel(x_ptr, y_ptr, s_ptr, width, stride_x, stride_y, stride_s,
               ACT: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr, MIN_AMAX: tl.constexpr,
               BLOCK: tl.constexpr, GROUPS: tl.constexpr, ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0,
               CLAMP: tl.constexpr = 0.0, PDL: tl.constexpr = False):
    # y = _gated_act(x[:, :width], x[:, width:]) for GROUPS x BLOCK channels of one row; with QUANT, FP8 with
    # one scale per BLOCK (= the quantization group) channels.
    prior_done(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = offs < width
    gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=ok, other=0.0).to(tl.float32)
    v = _gated_act(gate, up, ACT, ALPHA, LIMIT, CLAMP)
    if QUANT:
        # Masked channels are 0 and do not move a group's maximum; y holds bytes.
        q, scale = quant_groups(v, MIN_AMAX, UE8M0)
        tl.store(y_ptr + row * stride_y + offs, q, mask=ok)
        tl.store(s_ptr + row * stride_s + g, scale, mask=g * BLOCK < width)
    else:
        tl.store(y_ptr + row * stride_y + offs, v.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sum_kernel(x_ptr, add_ptr, out_ptr, width, TOP_K: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr,
               PDL: tl.constexpr = False):
    # out[t] = add[t] + sum_j x[t * TOP_K + j] over the k (already weighted) rows of token t, in float32.
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if ADD:
        acc += tl.load(add_ptr + t * width + offs, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * width + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * width + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, num_groups, topk_group,
                 scale, stride_l,
                 SIGMOID: tl.constexpr, GROUP_SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                 TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr = False):
    # One token per program, all in registers.
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    ok = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    _route_row(x, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, group_size, num_groups, topk_group, scale,
               SIGMOID, GROUP_SCORE, HAS_BIAS, RENORM, TOP_K, K_POW2, E_POW2)


@triton.jit(do_not_specialize=["hidden", "stride_x"])
def router_kernel(x_ptr, w_ptr, logits_ptr, arrivals_ptr, bias_ptr, weights_ptr, ids_ptr, hidden, num_experts,
                  group_size, num_groups, topk_group, scale, stride_x, stride_w, stride_l,
                  SIGMOID: tl.constexpr, GROUP_SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    # Program (token, block of experts): float32 logits of x . w for its BLOCK_E experts; the token's last program
    # to finish routes the token as route_kernel does, so the GEMV and the choice are one launch.
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        xv = tl.load(x_ptr + t * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None] * stride_w + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(logits_ptr + t * stride_l + offs_e, tl.sum(acc, 1), mask=e_ok)
    if last_arrival(arrivals_ptr + t, tl.num_programs(1)):
        offs = tl.arange(0, E_POW2)
        ok = offs < num_experts
        x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        _route_row(x, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, group_size, num_groups, topk_group, scale,
                   SIGMOID, GROUP_SCORE, HAS_BIAS, RENORM, TOP_K, K_POW2, E_POW2)


@triton.jit
def _route_row(x, offs, ok, t, bias_ptr, weights_ptr, ids_ptr, group_size, num_groups, topk_group, scale,
               SIGMOID: tl.constexpr, GROUP_SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
               TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr):
    # One token's logits x [E_POW2] (-inf past the experts) -> its weights and ids: the torch ops of
    # moe.select_experts_reference in order. GROUP_SCORE: 0 no groups, 1 a group's best expert, 2 its two best.
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        e = tl.exp(x - tl.max(x, 0))
        scores = e / tl.sum(e, 0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=ok, other=0.0)
    choice = tl.where(ok, choice, float("-inf"))
    if GROUP_SCORE != 0:
        gid = offs // group_size
        group = tl.full([E_POW2], float("-inf"), tl.float32)  # each expert's group score
        for g in range(0, num_groups):
            v = tl.where(gid == g, choice, float("-inf"))
            best = tl.max(v, 0)
            if GROUP_SCORE == 2:
                best += tl.max(tl.where(offs == tl.argmax(v, 0), float("-inf"), v), 0)
            group = tl.where(gid == g, best, group)
        keep = offs < 0
        for _ in range(0, topk_group):
            g = tl.argmax(group, 0) // group_size  # the best group left (the lowest id on ties)
            keep = keep | (gid == g)
            group = tl.where(gid == g, float("-inf"), group)
        # Softmax routing zeroes the experts of other groups, sigmoid routing excludes them.
        choice = tl.where(keep | ~ok, choice, float("-inf") if SIGMOID else 0.0)
    slot = tl.arange(0, K_POW2)
    top_w = tl.zeros([K_POW2], dtype=tl.float32)
    top_i = tl.zeros([K_POW2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        i = tl.argmax(choice, 0)
        # Sigmoid routing weighs by the score without the bias; softmax by the (group-masked) score.
        w = tl.sum(tl.where(offs == i, scores if SIGMOID else choice, 0.0), 0)
        top_w = tl.where(slot == j, w, top_w)
        top_i = tl.where(slot == j, i.to(tl.int64), top_i)
        choice = tl.where(offs == i, float("-inf"), choice)
    if RENORM:
        top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slot, top_w * scale, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, top_i, mask=slot < TOP_K)
