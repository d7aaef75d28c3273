"""fp8 (e4m3fn) and bf16 encodings by integer arithmetic on the float32 bits, shared by the kernels that store
or quantize (the KV store, the MLA layouts, the FP8 activation quantization) and those that read fp8 bytes.

Not casts: Triton's interpreter mis-rounds float -> fp8 casts whose rounding carries into the exponent and does
not round float32 -> bfloat16 to nearest, and these run on GPUs without fp8 support too. NaN stays NaN: the
clamp's tl.minimum/maximum would drop it, and the GPU's NaN (0x7FFFFFFF) would carry into the sign.
"""
import triton
import triton.language as tl


@triton.jit
def fp8_bytes(x):
    """float32 -> float8 e4m3fn bytes, round to nearest even, saturating at +-448 like the reference; NaN ->
    the NaN byte (0x7F, sign kept) as torch's cast gives.

    Integer arithmetic on the float32 bits rather than a cast: the interpreter's cast drops the carry
    when rounding overflows the mantissa (1.97 -> 1.0), and this also runs on GPUs without fp8 (SM80).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.uint8) << 7
    nan = (bits & 0x7FFFFFFF) > 0x7F800000  # tl.minimum/maximum would drop it
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    a = tl.abs(x)
    # Normal range: round the 23-bit mantissa to 3 bits; a carry moves into the exponent by itself.
    ab = a.to(tl.uint32, bitcast=True)
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20
    normal = (r - (120 << 3)).to(tl.uint8)  # rebias the exponent: 127 - 7
    # Subnormals (below 2^-6): multiples of 2^-9, rounded to nearest even by the float add.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint8)
    return tl.where(nan, 0x7F, tl.where(a < 0.015625, sub, normal)) | sign


@triton.jit
def fp8_value(b):
    """float8 e4m3fn bytes -> float32 (exact; the NaN bytes 0x7F and 0xFF -> NaN)."""
    b = b.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    normal = ((b >> 7) << 31) | tl.where((b & 0x7F) == 0x7F, 0x7FC00000, ((e + 120) << 23) | (m << 20))
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, 0.0)
    val = tl.where((e == 0) & ((b >> 7) == 1), -val, val)
    return tl.where(e == 0, val, normal.to(tl.float32, bitcast=True))


@triton.jit
def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (as torch), not carried into the sign."""
    bits = x.to(tl.uint32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
