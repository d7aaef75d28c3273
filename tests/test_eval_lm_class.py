"""evals/lm.py: the lm-eval model class on test_evals.py's tiny random Llama (scores, generation in input order,
registration by import alone, ``simple_evaluate(model="attnzoo")``)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from helpers import fresh_python  # noqa: E402
from test_evals import tiny_data, tiny_model  # noqa: E402,F401 (module fixtures: the model and GSM8K-shaped data)


def test_lm_class_scores_and_generates(tiny_model):
    from lm_eval.api.instance import Instance

    from attnzoo import load_model
    from attnzoo.evals.lm import AttnzooLM

    llm = load_model(tiny_model, device="cpu", dtype="float32")
    lm = AttnzooLM(llm=llm)
    ctx, cont = "Tom has 3 apples.", " He eats 1."
    (ll, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)], disable_tqdm=True)
    ids_ctx, ids_all = lm.tok_encode(ctx), lm.tok_encode(ctx + cont)
    logp = torch.log_softmax(llm.logits(ids_all[:-1]), -1)
    want = sum(logp[i - 1, ids_all[i]].item() for i in range(len(ids_ctx), len(ids_all)))
    assert ll == pytest.approx(want, abs=1e-4) and isinstance(greedy, bool)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ctx,), 0)], disable_tqdm=True)
    ids = [lm.prefix_token_id] + lm.tok_encode(ctx)
    logp = torch.log_softmax(llm.logits(ids[:-1]), -1)
    assert rolling == pytest.approx(sum(logp[i - 1, ids[i]].item() for i in range(1, len(ids))), abs=1e-4)
    # Mixed generation settings: every request gets its own limit, results come back in input order.
    reqs = [Instance("generate_until", {}, (f"Question {i}:", {"until": ["\n\n"], "max_gen_toks": 2 + i % 3}), i,
                     metadata=("t", i, 1)) for i in range(6)]
    outs = lm.generate_until(reqs, disable_tqdm=True)
    direct = [llm.generate([lm.tok_encode(r.args[0])], max_new_tokens=r.args[1]["max_gen_toks"],
                           stop=["\n\n", "</s>"])[0].text.split("\n\n")[0] for r in reqs]
    assert outs == direct
    assert sorted(g.doc_id for g in lm.records) == list(range(6))
    assert all(1 <= g.output_tokens <= 2 + g.doc_id % 3 for g in lm.records)


def test_importing_the_model_module_registers_it_and_nothing_else_does():
    """A fresh interpreter: `import attnzoo.evals.lm` alone makes `model="attnzoo"` resolvable (lm-eval's own
    models too); `import attnzoo` leaves lm-eval alone."""
    code = ("import sys, attnzoo, attnzoo.evals; assert 'lm_eval' not in sys.modules, 'import attnzoo touched lm-eval'\n"
            "import attnzoo.evals.lm as m\n"
            "from lm_eval.api.registry import get_model\n"
            "assert get_model('attnzoo') is m.AttnzooLM and get_model('hf').__name__ == 'HFLM'\n"
            "m.register(); assert get_model('attnzoo') is m.AttnzooLM\n")
    res = fresh_python(code)
    assert res.returncode == 0, res.stderr[-2000:]


def test_registered_for_lm_eval(tiny_model, tiny_data):
    """`simple_evaluate(model="attnzoo", model_args="pretrained=...,backend=...")` with no register() call."""
    import lm_eval
    from lm_eval.api.registry import get_model

    from attnzoo.evals.lm import AttnzooLM
    from attnzoo.evals.tasks import check_data_dir, load_tasks

    assert get_model("attnzoo") is AttnzooLM and get_model("hf").__name__ == "HFLM"
    tm, tasks = load_tasks("gsm8k", check_data_dir("gsm8k", tiny_data))
    res = lm_eval.simple_evaluate(
        model="attnzoo", model_args=f"pretrained={tiny_model},backend=torch,page_size=32,device=cpu,dtype=float32",
        tasks=list(tasks["tasks"].values()), limit=2, num_fewshot=1, gen_kwargs={"max_gen_toks": 4}, task_manager=tm,
    )
    assert "exact_match,flexible-extract" in res["results"]["gsm8k"]
    assert res["config"]["page_size"] == 32 and res["config"]["prefill_backend"] == "torch"
    assert res["config"]["decision"]["decode_backend"] == "torch" and json.dumps(res["config"]["decision"])
