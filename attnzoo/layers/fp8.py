"""FP8 block-scaled linear layers, in the format of the official DeepSeek-V3/V3.1/V3.2 checkpoints.

A weight W [N, K] is stored as float8_e4m3fn plus ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)]:
W ~= W8 * scale_inv, one factor per 128x128 block (blocks at the right and bottom edges may be partial).
Activations are quantized on the fly per token and per group of 128 input features (DeepSeek's
``act_quant``: scale = max|x| / 448 over the group, rounded up to a power of two under ``scale_fmt:
ue8m0``), so a GEMM tile of 128 input features carries one activation and one weight factor:

    y[m, n] = sum_kb  a_scale[m, kb] * w_scale[n // 128, kb] * sum_{k in kb} x8[m, k] * w8[n, k]

GEMM paths: ``torch._scaled_mm`` blockwise (1x128 activations x 128x128 weights, cuBLAS) on SM90 when N
and K are multiples of 128 and it answers a probe; our Triton kernel elsewhere on GPUs with FP8 tensor
cores (SM89+); on CPU a torch emulation of the same arithmetic (float32), the oracle the kernels are
tested against.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo import pdl
from attnzoo.errors import WeightError
from attnzoo.layers import fused

log = logging.getLogger("attnzoo")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
# DeepSeek's act_quant clamps the group maximum so an all-zero group gets a finite scale.
MIN_AMAX = 1e-4
# Quantization groups per program of the activation kernels (here and the MoE's act-and-quantize): one group
# per program makes tens of thousands of tiny programs at large batches, each too short to reach bandwidth.
GROUPS_PER_PROGRAM = 4
# Random-weight models draw FP8 codes directly (``random_codes_``): a random sign and mantissa at exponent 0,
# +-[1, 1.875], whose root mean square this is; a block factor of std / CODE_RMS gives weights of that std.
CODE_RMS = math.sqrt(sum((1 + m / 8) ** 2 for m in range(8)) / 8)


# ------------------------------------------------------------------------------------------ format


@dataclass(frozen=True)
class Fp8Format:
    """What a checkpoint's ``quantization_config`` says; only DeepSeek's block format is accepted."""

    block_n: int = 128
    block_k: int = 128
    ue8m0: bool = False  # activation scales rounded up to powers of two (V3.1/V3.2 ``scale_fmt``)

    def describe(self) -> str:
        return f"fp8 block {self.block_n}x{self.block_k}, e4m3" + (", ue8m0 scales" if self.ue8m0 else "")

    @classmethod
    def from_config(cls, config) -> Fp8Format | None:
        """None for an unquantized config; a WeightError for any quantization this module cannot run."""
        text = getattr(config, "text_config", None) or config
        qc = getattr(text, "quantization_config", None) or getattr(config, "quantization_config", None)
        if qc is None:
            return None
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
        fix = ('use a checkpoint with quantization_config {"quant_method": "fp8", "fmt": "e4m3", '
               '"activation_scheme": "dynamic", "weight_block_size": [128, 128]} (the official DeepSeek-V3 '
               'format), or a bf16 checkpoint')
        method = qc.get("quant_method")
        if method != "fp8":
            raise WeightError(f"quantization_config.quant_method {method!r} is not supported", fix=fix)
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise WeightError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)", fix=fix)
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise WeightError(
                f"quantization_config.activation_scheme {scheme!r} is not supported (activations are quantized "
                "per token group at run time)", fix=fix)
        block = qc.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise WeightError(
                f"quantization_config.weight_block_size {block!r} is not supported (only [128, 128] blocks; "
                "per-tensor FP8 has no block size)", fix=fix)
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise WeightError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported (none or 'ue8m0')", fix=fix)
        return cls(128, 128, scale_fmt == "ue8m0")


# ------------------------------------------------------------------------------ torch reference


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (W8 float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]), as the
    checkpoints store it (tests and benchmarks make FP8 checkpoints with it)."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX  # [nb, kb]
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def random_codes_(w8: torch.Tensor) -> torch.Tensor:
    """Fill a contiguous float8_e4m3fn tensor in place with random codes +-[1, 1.875] (sign and 3 mantissa
    bits uniform; never NaN) from its device's RNG: 64 random bits per 8 codes, then two bitwise passes and
    no temporary, so a whole stack of experts takes three passes over its bytes on its own device."""
    b = w8.view(torch.uint8).view(-1)
    whole = b.numel() // 8 * 8
    if whole:
        b[:whole].view(torch.int64).random_(-(2**63), None)  # every bit uniform (the full int64 range)
    if whole < b.numel():
        b[whole:].random_(0, 256)
    b.bitwise_and_(0x87).bitwise_or_(0x38)  # keep sign and mantissa; exponent field 7 (2^0)
    return w8


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), *,
               dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """W8 [N, K] and its block factors -> W [N, K] in ``dtype``."""
    n, k = w8.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise WeightError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in {bn}x{bk} blocks needs {expected}",
            fix="the checkpoint's scales do not match its weights or its weight_block_size; re-export it")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w8.float() * s).to(dtype)


def act_quant_reference(x: torch.Tensor, group: int = GROUP, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 float8_e4m3fn [M, K], scales float32 [M, ceil(K/group)]), x ~= x8 * scale per group."""
    m, k = x.shape
    g = -(-k // group)
    xg = F.pad(x.float(), (0, g * group - k)).view(m, g, group)
    amax = xg.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    # A tensor divisor: CUDA turns division by a Python scalar into a multiplication by its rounded
    # reciprocal, one ulp off the IEEE quotient the kernels compute.
    s = amax / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, g * group)[:, :k].contiguous(), s


def w8a8_block_matmul_reference(x8, x_scale, w8, w_scale, block=(128, 128), out_dtype=torch.float32) -> torch.Tensor:
    """The arithmetic of the FP8 GEMM in float32: dequantize both operands and multiply."""
    m, k = x8.shape
    x = (x8.float().view(m, -1) * x_scale.float().repeat_interleave(block[1], 1)[:, :k])
    return (x @ dequantize(w8, w_scale, block).t()).to(out_dtype)


# ---------------------------------------------------------------------------------- Triton kernels


@functools.cache
def _kernels():
    # Triton is imported on first use only: CPU-only installs load FP8 checkpoints without it.
    from attnzoo.layers import fp8_kernels

    return fp8_kernels


def act_quant(x: torch.Tensor, group: int = GROUP, ue8m0: bool = False, *,
              column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``act_quant_reference``. ``column_major_scales``: the scales come back as a
    [M, G] view of a [G, M] tensor, the layout cuBLAS's blockwise GEMM reads."""
    m, k = x.shape
    g = -(-k // group)
    y = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(g, m, dtype=torch.float32, device=x.device).t() if column_major_scales else \
        torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m:
        per = GROUPS_PER_PROGRAM
        _kernels().act_quant_kernel[(m, -(-g // per))](x, y.view(torch.uint8), s, k, x.stride(0), y.stride(0),
                                                       s.stride(0), s.stride(1), GROUP=group, GROUPS=per,
                                                       UE8M0=ue8m0, MIN_AMAX=MIN_AMAX)
    return y, s


def _tile_config(m: int) -> dict:
    # Small M is bound by reading the weights: narrow tiles give more programs to stream them.
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def w8a8_block_matmul(x8, x_scale, w8, w_scale, block=(128, 128), out_dtype=torch.bfloat16, *,
                      split_k: int | None = None) -> torch.Tensor:
    """x8 [M, K] fp8 with per-(row, group) scales, w8 [N, K] fp8 with block scales -> [M, N] out_dtype.

    ``split_k``: K tiles split over this many programs per output tile (None: enough to fill the GPU
    when the output has few tiles, as decode batches do); partial sums meet in a float32 buffer.
    """
    m, k = x8.shape
    n = w8.shape[0]
    if block[1] != GROUP:
        raise WeightError(f"block K {block[1]} is not the activation group {GROUP}", fix="use 128x128 blocks")
    cfg = _tile_config(m)
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    k_tiles = -(-k // GROUP)
    if split_k is None:
        sms = pdl.sm_count(x8.device.index or 0) if x8.is_cuda else 1
        split_k = 1 if tiles >= sms else min(k_tiles, 16, -(-2 * sms // tiles))
    split_k = max(1, min(split_k, k_tiles))
    out = torch.empty(m, n, dtype=out_dtype, device=x8.device)
    if m == 0:
        return out
    c = out[None] if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x8.device)
    _kernels().block_matmul_kernel[(tiles, split_k)](
        x8, w8, c, x_scale, w_scale, m, n, k,
        x8.stride(0), x8.stride(1), w8.stride(0), w8.stride(1), c.stride(0), c.stride(1), c.stride(2),
        x_scale.stride(0), x_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
        GROUP_N=block[0], GROUP_K=block[1], GROUP_M=8, SPLIT_K=split_k, **cfg,
    )
    return out if split_k == 1 else c.sum(0).to(out_dtype)


# --------------------------------------------------------------------------------- GEMM selection

GEMM_TORCH = "torch emulation (float32, cpu)"
GEMM_TRITON = "triton w8a8 block fp8"
GEMM_SCALED_MM = "torch._scaled_mm blockwise 1x128/128x128 (cublas)"


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: SM89 (Ada) and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _scaled_mm_works(device_index: int) -> bool:
    """One small blockwise call: cuBLAS builds without blockwise FP8 raise, and then Triton runs."""
    dev = torch.device("cuda", device_index)
    try:
        w8, ws = quantize_weight(torch.randn(256, 256, device=dev))
        x8, xs = act_quant(torch.randn(32, 256, device=dev), column_major_scales=True)
        got = _scaled_mm(x8, xs, w8, _scaled_mm_weight_scale(ws), torch.bfloat16).float()
        ref = w8a8_block_matmul_reference(x8, xs, w8, ws)
        ok = bool(((got - ref).abs().max() <= 0.02 * ref.abs().max()).item())
        if not ok:
            log.warning("torch._scaled_mm blockwise disagrees with the reference here; FP8 GEMMs use Triton")
        return ok
    except RuntimeError as e:
        log.info("torch._scaled_mm blockwise is unavailable here (%s); FP8 GEMMs use Triton", str(e).splitlines()[0])
        return False


def _scaled_mm_weight_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] -> the [round_up(K/128, 4), N/128] column-major layout cuBLAS reads."""
    nb, kb = w_scale.shape
    padded = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=w_scale.device)
    padded[:, :kb] = w_scale
    return padded.t()


def _scaled_mm(x8, x_scale, w8, w_scale_t, out_dtype):
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(x8, w8.t(), scale_a=x_scale, scale_recipe_a=ScalingType.BlockWise1x128,
                     scale_b=w_scale_t, scale_recipe_b=ScalingType.BlockWise128x128, output_dtype=out_dtype)


def choose_gemm(device: torch.device, n: int, k: int, out_dtype: torch.dtype) -> str:
    if device.type != "cuda":
        return GEMM_TORCH
    if (torch.cuda.get_device_capability(device) == (9, 0) and n % 128 == 0 and k % 128 == 0
            and out_dtype == torch.bfloat16 and _scaled_mm_works(device.index or 0)):
        return GEMM_SCALED_MM
    return GEMM_TRITON


# ------------------------------------------------------------------------------------------ module


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as the checkpoint stores it: ``weight`` float8_e4m3fn [N, K] and
    ``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)]. ``prepare()`` picks the GEMM once the weights
    are on their device."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fmt: Fp8Format = Fp8Format(),
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.block = (fmt.block_n, fmt.block_k)
        nb, kb = -(-out_features // fmt.block_n), -(-in_features // fmt.block_k)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(nb, kb, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.gemm = GEMM_TORCH
        self._scale_t = None  # weight scales in cuBLAS's layout, for GEMM_SCALED_MM

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Fp8Format, *, random: bool) -> Fp8Linear:
        """An FP8 layer of ``linear``'s shape (its bias kept); ``random`` weights (``init_random_``, random-weight
        models), else left for the checkpoint to fill. ``linear``'s own weight is never read."""
        dev = linear.weight.device
        mod = cls._shaped_like(linear, fmt, dev)
        if linear.bias is not None:
            mod.bias = linear.bias
        if random and dev.type != "meta":
            mod.init_random_()
        return mod

    @classmethod
    def _shaped_like(cls, linear, fmt: Fp8Format, device) -> Fp8Linear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, fmt, device=device)

    def init_random_(self, std: float | None = None) -> Fp8Linear:
        """Random FP8 codes and one factor for every block, drawn on the weight's device, giving weights of
        standard deviation ``std`` (None: nn.Linear's default init, 1 / sqrt(3 * in_features))."""
        std = (3 * self.in_features) ** -0.5 if std is None else std
        with torch.no_grad():
            random_codes_(self.weight)
            self.weight_scale_inv.fill_(std / CODE_RMS)
        return self

    def _apply(self, fn, recurse=True):
        # model.to(dtype) converts floating-point parameters; FP8 codes and their float32 factors must
        # keep their types (only moves between devices apply).
        w, s = self.weight.data, self.weight_scale_inv.data
        super()._apply(fn, recurse)
        # Integer views pass through dtype conversions untouched.
        self.weight.data = fn(w.view(torch.uint8)).view(FP8)
        self.weight_scale_inv.data = fn(s.view(torch.int32)).view(torch.float32)
        return self

    def prepare(self, out_dtype: torch.dtype) -> str:
        self.gemm = choose_gemm(self.weight.device, self.out_features, self.in_features, out_dtype)
        self._scale_t = _scaled_mm_weight_scale(self.weight_scale_inv) if self.gemm == GEMM_SCALED_MM else None
        return self.gemm

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.gemm == GEMM_SCALED_MM:
            m = x2.shape[0]
            if m % 4:
                # cuBLASLt finds no blockwise algorithm unless the activation scales' leading dimension
                # (M, column-major) is 16-byte aligned: at M=1 it raised CUBLAS_STATUS_NOT_SUPPORTED (H200).
                x2 = torch.nn.functional.pad(x2, (0, 0, 0, 4 - m % 4))
            x8, xs = act_quant(x2, self.block[1], self.fmt.ue8m0, column_major_scales=True)
            y = _scaled_mm(x8, xs, self.weight, self._scale_t, x.dtype)[:m]
        else:
            quant = act_quant if self.gemm == GEMM_TRITON else act_quant_reference
            x8, xs = quant(x2, self.block[1], self.fmt.ue8m0)
            y = self._block_gemm(x8, xs, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _block_gemm(self, x8, xs, out_dtype) -> torch.Tensor:
        gemm = w8a8_block_matmul if self.gemm == GEMM_TRITON else w8a8_block_matmul_reference
        return gemm(x8, xs, self.weight, self.weight_scale_inv, self.block, out_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.fmt.describe()}, gemm={self.gemm}")


def _stacked(sizes: dict[str, int]) -> dict[str, slice]:
    rows, start = {}, 0
    for name, n in sizes.items():
        rows[name] = slice(start, start + n)
        start += n
    return rows


class Fp8MergedLinear(Fp8Linear):
    """The FP8 form of ``models.common.MergedLinear`` (gate/up, q/k/v stacked into one layer), its parts
    as the checkpoint stores them: ``weight`` is the parts' FP8 weights stacked [sum N, K] and
    ``weight_scale_inv`` their block factors stacked [sum ceil(N_i/bn), ceil(K/bk)]; each part's tensors
    load into ``part_rows()`` / ``scale_rows()``.

    When every part's N but the last is a multiple of bn (DeepSeek-V3: 18432 and 2048; q_a 1536 and
    kv_a 576), the stacked factors are exactly the merged weight's blocks and one GEMM runs. Otherwise a
    block of bn output rows would straddle two parts with different factors, so each part runs its own
    GEMM on its rows (outputs concatenated; the input is quantized once), which keeps the result exactly
    that of separate layers.

    Tensor parallel: each part's ``cuts`` (checkpoint weight -> this rank's rows) and ``scale_cuts``
    (its factors -> the factors of those rows' blocks), or None where the part is whole."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, fmt: Fp8Format = Fp8Format(),
                 device=None):
        super().__init__(in_features, sum(parts.values()), bias, fmt, device)
        self.parts = dict(parts)
        self.aligned = all(n % fmt.block_n == 0 for n in list(parts.values())[:-1])
        blocks = {name: -(-n // fmt.block_n) for name, n in parts.items()}
        self._scale_rows = _stacked(blocks)
        kb = self.weight_scale_inv.shape[1]
        self.weight_scale_inv = nn.Parameter(torch.ones(sum(blocks.values()), kb, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.cuts, self.scale_cuts = dict.fromkeys(parts), dict.fromkeys(parts)

    @classmethod
    def _shaped_like(cls, linear, fmt: Fp8Format, device) -> Fp8MergedLinear:
        return cls(linear.in_features, linear.parts, linear.bias is not None, fmt, device=device)

    def part_rows(self) -> dict[str, slice]:
        return _stacked(self.parts)

    def scale_rows(self) -> dict[str, slice]:
        """Each part's rows of ``weight_scale_inv``."""
        return dict(self._scale_rows)

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """As ``MergedLinear.forward``: with ``act`` (parts gate then up), act(gate) * up."""
        y = super().forward(x)
        return y if act is None else fused.act_and_mul(y, act)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.parts.values()), dim=-1)

    def prepare(self, out_dtype: torch.dtype) -> str:
        # cuBLAS's blockwise GEMM takes the stacked factors as one weight's blocks: aligned parts only.
        if super().prepare(out_dtype) == GEMM_SCALED_MM and not self.aligned:
            self.gemm, self._scale_t = GEMM_TRITON, None
        return self.gemm

    def _parts(self):
        return zip(self.part_rows().values(), self.scale_rows().values())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([dequantize(self.weight[r], self.weight_scale_inv[s], self.block, dtype=dtype)
                          for r, s in self._parts()])

    def _block_gemm(self, x8, xs, out_dtype) -> torch.Tensor:
        if self.aligned:
            return super()._block_gemm(x8, xs, out_dtype)
        gemm = w8a8_block_matmul if self.gemm == GEMM_TRITON else w8a8_block_matmul_reference
        return torch.cat([gemm(x8, xs, self.weight[r], self.weight_scale_inv[s], self.block, out_dtype)
                          for r, s in self._parts()], dim=-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", parts={self.parts}" + ("" if self.aligned else " (one GEMM each)")

