"""The compressed-attention (DeepSeek-V4) Triton kernels under the interpreter against the torch reference
(attention/compressed_reference.py) on tiny shapes: window + compressed entries (HCA: all, CSA: the
indexer's picks, sliding: none) with sinks, and the indexer's scores + top-k, in extend and decode steps."""
import pytest
import torch

from attnzoo.attention.compressed import CompressedAttention
from attnzoo.attention.compressed_reference import attend_reference, topk_reference
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import build_metadata
from attnzoo.attention.reference import select_topk, token_requests

GPU = torch.cuda.is_available()
interpreter = pytest.mark.skipif(GPU, reason="interpreter check; the gpu tests run the kernels on CUDA")
PS, D, H, DI, HI = 4, 32, 4, 16, 2


def _case(kind, decode, seed=0, heads=H):
    rate = {"sliding": 0, "hca": 8, "csa": 4}[kind]
    layer = CompressedAttention(0, heads, D, sliding_window=6, scale=D**-0.5, compress_rate=rate, overlap=kind == "csa",
                                state_dim=8 if rate else 0, index_dim=DI if kind == "csa" else 0,
                                index_n_heads=HI if kind == "csa" else 0, index_topk=3 if kind == "csa" else 0)
    pool = KVPool([layer.kv_cache_spec()], num_pages=40, page_size=PS, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    names = ["k"] + (["compressed"] if rate else []) + (["index_compressed"] if kind == "csa" else [])
    for name in names:
        v = pool.view(0, name)
        v.copy_(torch.randn(v.shape, generator=g))
    prefix, q_lens = ([17, 30, 9], [1, 1, 1]) if decode else ([0, 13, 21], [19, 5, 1])
    tables = [list(range(1 + 10 * i, 1 + 10 * i + -(-(p + n) // PS))) for i, (p, n) in enumerate(zip(prefix, q_lens))]
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=PS, device="cpu")
    t = meta.num_tokens
    q = torch.randn(t, heads, D, generator=g)
    sinks = torch.randn(heads, generator=g)
    return layer, pool, meta, q, sinks, g


@interpreter
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_attend_and_topk_match_reference(kind, decode):
    from attnzoo.attention.kernels import compressed as kernels

    layer, pool, meta, q, sinks, g = _case(kind, decode)
    ids = None
    reqs = token_requests(meta)
    if kind == "csa":
        iq, w = torch.randn(q.shape[0], HI, DI, generator=g), torch.rand(q.shape[0], HI, generator=g)
        keys = pool.view(0, "index_compressed")
        want = topk_reference(keys, iq, w, meta, rate=4, topk=3, scale=DI**-0.5)
        s = kernels.scores(iq, w, keys.reshape(-1, DI), meta.block_tables, reqs, meta.positions,
                           width=meta.max_seq_len // 4, rate=4, page_size=PS, scale=DI**-0.5)
        got = select_topk(s, 3)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        ids = want
    comp = pool.view(0, "compressed") if layer.compress_rate else None
    want = attend_reference(pool.k(0), comp, q, sinks, ids, meta, window=6, rate=layer.compress_rate, scale=layer.scale)
    got = kernels.attend(q, pool.k(0).reshape(-1, D), None if comp is None else comp.reshape(-1, D), sinks,
                         meta.block_tables, meta.block_tables, reqs, meta.positions, ids, window=6,
                         rate=layer.compress_rate, page_size=PS, scale=layer.scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)



def _attend_checked(kind, decode, heads, cfg, seed=3):
    from attnzoo.attention.kernels import compressed as kernels

    layer, pool, meta, q, sinks, g = _case(kind, decode, seed=seed, heads=heads)
    ids = None
    if kind == "csa":
        iq, w = torch.randn(q.shape[0], HI, DI, generator=g), torch.rand(q.shape[0], HI, generator=g)
        ids = topk_reference(pool.view(0, "index_compressed"), iq, w, meta, rate=4, topk=3, scale=DI**-0.5)
    comp = pool.view(0, "compressed") if layer.compress_rate else None
    want = attend_reference(pool.k(0), comp, q, sinks, ids, meta, window=6, rate=layer.compress_rate,
                            scale=layer.scale)
    got = kernels.attend(q, pool.k(0).reshape(-1, D), None if comp is None else comp.reshape(-1, D), sinks,
                         meta.block_tables, meta.block_tables, token_requests(meta), meta.positions, ids, window=6,
                         rate=layer.compress_rate, page_size=PS, scale=layer.scale, config=cfg)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_attend_with_several_head_blocks_per_token(kind, decode):
    """20 heads in blocks of 16: each token's programs are neighbours in one flat grid, the last block part
    empty; and the GPU's tiles for wide heads (all heads in one program, 32 keys a step) on 40 heads."""
    from attnzoo.attention.kernels.compressed import attend_tiles

    _attend_checked(kind, decode, 20, {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    _attend_checked(kind, decode, 40, attend_tiles(40, 512, True))


def test_attend_tiles_cover_every_head_on_the_gpu():
    from attnzoo.attention.kernels.compressed import attend_tiles

    cfg = attend_tiles(64, 512, True)  # V4-Flash: one program reads each key once for all 64 heads
    assert (cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_stages"]) == (64, 32, 2)
    assert attend_tiles(128, 512, True)["BLOCK_H"] == 64  # more heads: several blocks, none wider than 64


@interpreter
def test_model_on_the_interpreter_matches_transformers(tmp_path):
    """The whole model through compressed_triton (Triton interpreter): a 30-token prefill (past the window,
    CSA entries past the top-k) and decode steps that complete blocks, against transformers."""
    import attnzoo
    from helpers import assert_matches_hf, random_prompts, save_checkpoint
    from test_deepseek_v4 import MODELS, VOCAB, tiny_v4

    hf = tiny_v4(*MODELS["all-kinds"])
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=8, backend="compressed_triton", device="cpu")
    assert llm.info()["decode_backend"] == "compressed_triton"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [30]), steps=4)



@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_every_v4_backend_matches_torch_and_transformers(tmp_path):
    """On CUDA, float32: compressed_triton against transformers (logits within 1e-4, greedy equal) and its
    bf16 greedy decode against the torch backend's (mixed batch, window page group, a prefix hit)."""
    import attnzoo
    from helpers import assert_greedy_close, assert_matches_hf, random_prompts, save_checkpoint
    from test_deepseek_v4 import MODELS, VOCAB, tiny_v4

    hf = tiny_v4(*MODELS["all-kinds"])
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=8, backend="compressed_triton", device="cuda", dtype="float32")
    assert llm.info()["decode_backend"] == "compressed_triton"
    # transformers on the GPU too: its indexer's top-k breaks ties between equal (ReLU-zero) scores differently
    # on the CPU and on CUDA (0.035 apart on the 41-token prompt), and ours breaks them as CUDA's does.
    assert_matches_hf(llm, hf.cuda(), random_prompts(VOCAB, [5, 41]), steps=20)
    hf.cpu()
    prefix = random_prompts(VOCAB, [23], seed=3)[0]
    prompts = [prefix + t for t in random_prompts(VOCAB, [3, 9, 14], seed=4)] + random_prompts(VOCAB, [30], seed=5)
    outs = {}
    for backend in ("torch", "compressed_triton"):
        m = attnzoo.load_model(tmp_path, page_size=2, backend=backend, device="cuda", dtype="bfloat16",
                               window_kv_fraction=0.5, max_batch_tokens=12)
        m.generate(prompts[:1], max_new_tokens=4, ignore_eos=True)
        outs[backend] = m.generate(prompts, max_new_tokens=16, ignore_eos=True, return_logits=True)
    assert_greedy_close(outs["compressed_triton"], outs["torch"], 0.05, "compressed_triton vs torch")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_gpu_cuda_graph_decode_matches_eager(tmp_path):
    """Decode through captured graphs (batches of 1, 3 and 7: padded rows) gives the eager path's tokens:
    block completion, the indexer's top-k and the window + compressed attention read the static buffers."""
    import attnzoo
    from helpers import random_prompts, save_checkpoint
    from test_deepseek_v4 import MODELS, VOCAB, tiny_v4

    save_checkpoint(tiny_v4(*MODELS["all-kinds"]), tmp_path)
    common = dict(page_size=4, backend="compressed_triton", device="cuda", dtype="float32", max_running=8)
    eager = attnzoo.load_model(tmp_path, cuda_graph=False, **common)
    graph = attnzoo.load_model(tmp_path, cuda_graph=True, **common)
    assert graph.info()["cuda_graph"] is not None
    for n in (1, 3, 7):
        prompts = random_prompts(VOCAB, [5 + 4 * i for i in range(n)], seed=n)
        a = eager.generate(prompts, max_new_tokens=24, ignore_eos=True, return_logits=True)
        b = graph.generate(prompts, max_new_tokens=24, ignore_eos=True, return_logits=True)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert (x.logits - y.logits).abs().max().item() < 1e-3
