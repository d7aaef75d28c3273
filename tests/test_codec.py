"""The kernels' fp8 and bf16 encodings by integer arithmetic (attnzoo/attention/kernels/codec.py) against torch's
casts, over every fp8 byte and a float32 sweep with the edge cases: under Triton's interpreter without a GPU, on
the GPU with one."""
import pytest
import torch

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"

try:  # kernels of the test's own around the codec (Triton resolves their globals at module level)
    import triton
    import triton.language as tl

    from attnzoo.attention.kernels.codec import bf16_bits, fp8_bytes, fp8_value

    @triton.jit
    def _encode_kernel(X, F8, B16, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n)
        tl.store(F8 + offs, fp8_bytes(x), mask=offs < n)
        tl.store(B16 + offs, bf16_bits(x), mask=offs < n)

    @triton.jit
    def _decode_kernel(B, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, fp8_value(tl.load(B + offs, mask=offs < n)), mask=offs < n)
except ImportError:
    _encode_kernel = None

pytestmark = pytest.mark.skipif(_encode_kernel is None, reason="needs Triton")


def words(values):
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in values], dtype=torch.int32).view(torch.float32)


def test_fp8_value_decodes_every_byte():
    b = torch.arange(256, dtype=torch.uint8, device=DEV)
    y = torch.empty(256, dtype=torch.float32, device=DEV)
    _decode_kernel[(1,)](b, y, 256, BLOCK=256)
    ref = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(y.isnan(), ref.isnan()) and ref.isnan().sum() == 2  # 0x7F and 0xFF
    assert torch.equal(y[~ref.isnan()], ref[~ref.isnan()])


def test_fp8_bytes_and_bf16_bits_equal_torch_casts():
    g = torch.Generator().manual_seed(0)
    edge = words([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF,
                  0x00000001, 0x80000000, 0x00000000, 0x3F808000, 0x3F818000, 0x3F80C000])
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every fp8 value ...
    ties = grid[~grid.isnan()] * (1 + 2.0**-4)  # ... and the halfway points above them
    x = torch.cat([edge, grid, ties, torch.tensor([447.9, 448.0, 449.0, 464.0, 480.0, 1e9, -1e9, 2.0**-10, 2.0**-9 * 1.5]),
                   torch.randn(4000, generator=g) * torch.logspace(-12, 4, 4000)]).to(DEV)
    f8 = torch.empty(x.shape, dtype=torch.uint8, device=DEV)
    b16 = torch.empty(x.shape, dtype=torch.int16, device=DEV)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, f8, b16, x.numel(), BLOCK=1024)
    nan = x.isnan()
    assert nan.sum() == 5 + 2  # the edge words' five and the grid's two
    ref8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    got8 = f8.view(torch.float8_e4m3fn)
    assert torch.equal(got8.float().isnan(), nan)  # NaN stays NaN (its sign is the input's)
    assert torch.equal(f8[~nan], ref8.view(torch.uint8)[~nan])
    got16 = b16.view(torch.bfloat16)
    assert torch.equal(got16.isnan(), nan)
    assert torch.equal(b16[~nan], x.to(torch.bfloat16).view(torch.int16)[~nan])
