"""The batched sampler: right distribution, top-k/top-p cuts, per-request seeds independent of the batch."""
import torch

from attnzoo.engine.sampling import SamplingParams, sample


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_draws_follow_the_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    p = SamplingParams(temperature=1.0)
    draws = sample(logits.repeat(n, 1), [p] * n, gens(range(n)))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03), freq


def test_top_k_and_top_p_cut_the_tail_per_row():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).repeat(3, 1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=2)]
    seen = [set(), set(), set()]
    for s in range(300):
        for row, tok in enumerate(sample(logits, params, gens([s, s + 1, s + 2])).tolist()):
            seen[row].add(tok)
    assert seen[0] == {0}  # top-k 1 is greedy
    assert seen[1] == {0, 1}  # 0.4 < 0.5, so the token crossing the line (0.3) stays
    assert seen[2] == {0, 1}


def test_seeded_request_ignores_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.8, top_p=0.9)
    alone = sample(logits[1:2], [p], gens([7]))
    batched = sample(logits, [p] * 3, gens([1, 7, 3]))
    assert alone.item() == batched[1].item()
