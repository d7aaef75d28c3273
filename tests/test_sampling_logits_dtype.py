"""Logits in the LM head's dtype (``CausalLM.compute_logits``): greedy decoding reads bf16 logits as they are, every
other use converts to float32 where it reads them, and the tokens, OVERFLOW and non-finite rows are those of the
logits' float32 copy."""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.engine.sampling import OVERFLOW, SamplingParams, pick_tokens, process_logits
from attnzoo.layers import fused
from helpers import random_prompts
from reliability_helpers import hf_model, tiny_dir  # noqa: F401  (fixtures: used by name)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 9000  # three of the Triton argmax's 4096-wide chunks
EOS = {3, 4100}


class Req:
    def __init__(self, params: SamplingParams, prompt=(5, 9, 5), out=(), seed: int | None = None):
        self.params, self.prompt, self.out = params, list(prompt), list(out)
        self.generator = None if seed is None else torch.Generator(DEVICE).manual_seed(seed)


def _half_logits(dtype: torch.dtype, rows: int) -> torch.Tensor:
    # bf16/fp16 values: a row of thousands holds ties by itself, placed across chunks here too
    x = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 4).to(dtype).to(DEVICE)
    top = x.float().max() + 1
    x[0, [4095, 4096, 8999]] = top.to(dtype)  # a tie across chunks: the first wins
    x[1, [10, 11]] = top.to(dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_argmax_finite_reads_half_logits_as_their_float32_copy(dtype, impl):
    x = _half_logits(dtype, 6)
    x[2, 17] = float("nan")
    x[3, VOCAB - 1] = float("inf")
    x[4] = float("-inf")
    x[5, : VOCAB // 2] = float("-inf")
    view = torch.cat([x, x], dim=1)[:, :VOCAB]  # rows strided past their length, as the LM head's vocab slice
    with fused.use(impl):
        got = fused.argmax_finite(view)
    with fused.use("torch"):
        want = fused.argmax_finite(view.float())
    assert got.tolist() == want.tolist()
    assert got[:5].tolist() == [4095, 10, -1, -1, -1] and got[5] >= VOCAB // 2


def _reqs() -> list[Req]:
    return [
        Req(SamplingParams()),  # greedy
        Req(SamplingParams(repetition_penalty=1.3), prompt=range(0, VOCAB, 7)),  # penalised greedy
        Req(SamplingParams(min_new_tokens=2), out=[1]),  # EOS masked
        Req(SamplingParams(temperature=0.7, top_k=50, top_p=0.9), seed=11),  # sampled, seeded
        Req(SamplingParams(temperature=1.3, repetition_penalty=0.8), prompt=range(1, VOCAB, 5), seed=12),
        Req(SamplingParams(temperature=1e-38), seed=13),  # the scaled logits overflow float32
        Req(SamplingParams()),  # a NaN row
        Req(SamplingParams(temperature=1.0), seed=14),  # an +inf row
        Req(SamplingParams(repetition_penalty=1.1)),  # a NaN row, penalised
    ]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_pick_tokens_on_bf16_logits_gives_the_float32_copys_tokens(impl):
    x = _half_logits(torch.bfloat16, 9)
    x[2, sorted(EOS)] = x[2].float().max().to(torch.bfloat16) + 8  # EOS would win but for min_new_tokens
    x[6, 100] = x[8, 200] = float("nan")
    x[7, 300] = float("inf")
    ref = x.float()
    with fused.use(impl):
        got, want = pick_tokens(x, _reqs(), EOS), pick_tokens(ref, _reqs(), EOS)
    assert got.tolist() == want.tolist()
    assert got[0] == 4095 and got[2] not in EOS and got[5] == OVERFLOW and got[[6, 7, 8]].tolist() == [-1, -1, -1]
    assert torch.equal(x.float().view(torch.int32), ref.view(torch.int32)), "pick_tokens changed the logits"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_process_logits_returns_a_float32_copy(dtype):
    # The penalty and the EOS mask are applied in float32 whatever the logits' dtype, never to the caller's rows.
    x = _half_logits(dtype, 2)
    before = x.clone()
    reqs = [Req(SamplingParams(repetition_penalty=1.5), prompt=[4095, 10]), Req(SamplingParams(min_new_tokens=1))]
    got = process_logits(x, reqs, EOS)
    assert got.dtype == torch.float32 and torch.equal(x, before)
    # (a GPU divides by a Python number as by its reciprocal: within an ulp of the penalty's division)
    torch.testing.assert_close(got[0, 4095], before[0, 4095].float() / 1.5, rtol=2e-7, atol=0.0)
    assert got[1, 3] == float("-inf")
    assert torch.equal(got[1, 5:4000], before[1, 5:4000].float())


def test_a_bf16_model_keeps_bf16_logits_and_greedy_reads_them(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="bfloat16", page_size=4, progress=False)
    hidden = torch.randn(3, llm.model.config.hidden_size).to(torch.bfloat16).to(llm.model.lm_head.weight.device)
    logits = llm.model.compute_logits(hidden)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, llm.model.lm_head(hidden))
    prompts = random_prompts(160, [5, 8], seed=3)
    outs = llm.generate(prompts, max_new_tokens=4, ignore_eos=True, return_logits=True)
    sp = attnzoo.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    for out, p in zip(outs, prompts):  # kept logits float32; each greedy token the argmax of its step's logits
        assert out.logits.dtype == torch.float32 and out.token_ids == out.logits.argmax(-1).tolist()
        got = llm.generate([p], sampling_params=sp)[0].outputs[0]
        want = torch.log_softmax(out.logits, dim=-1)  # log-probabilities of the float32 logits
        assert got.token_ids == out.token_ids
        for i, (t, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(lp[t].logprob - want[i, t].item()) < 1e-5, f"step {i}"
    assert llm.logits(prompts[0]).dtype == torch.float32
