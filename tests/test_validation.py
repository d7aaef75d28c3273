"""Reliability, third pass (issue 34, items 3, 4, 6, 7): no silent wrong result from a tiny temperature or
a config key the model does not implement, saved reports and output paths checked in full before a run,
named errors for bad prompts, chat content, templates, tensor names and GSM8K files, Ctrl-C in one line;
and a fault battery at the API and the command line (no raw traceback, every run bounded in time)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config

import attnzoo
from attnzoo.engine.sampling import SamplingParams, sample
from attnzoo.errors import EvalError, ModelLoadError, RequestError, WeightError
from attnzoo.models.registry import model_class
from helpers import assert_matches_hf, random_prompts, save_checkpoint
from test_deepseek import COMMON, tiny_v3
from test_gemma4 import F, text_config
from test_llama import tiny_llama

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_llama(kv_heads=2, heads=4), tmp_path_factory.mktemp("val_llama"))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, progress=False)


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is read: the error had to come first."""
    from attnzoo.models import loader

    monkeypatch.setattr(loader, "iter_weights", lambda *a, **k: pytest.fail("weights were read before the check"))


def _with_config(tiny_dir, tmp_path, **change) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _all_pages_free(llm) -> bool:
    e = llm.engine
    return e.allocator.num_free + e.prefix_cache.evictable() == e.allocator.capacity


# ------------------------------------------------------------------------------ 3. silent wrong results


def test_sampler_flags_a_temperature_whose_division_overflows():
    from attnzoo.engine.sampling import OVERFLOW

    logits = torch.tensor([[50.0, 1.0, -3.0], [0.5, 2.0, 1.0]])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    got = sample(logits, [SamplingParams(temperature=1e-38)] * 2, gens)
    # 50 / 1e-38 is inf in float32 (softmax NaN, argmax 0); 2 / 1e-38 is finite: the sharpest softmax, token 1.
    assert got.tolist() == [OVERFLOW, 1]


def test_tiny_temperature_is_named_not_token_0(llm, monkeypatch):
    real = llm.model.compute_logits
    monkeypatch.setattr(llm.model, "compute_logits", lambda hidden: real(hidden) * 100)  # logits of a real model's size
    prompts = random_prompts(160, [5, 7], seed=50)
    with pytest.raises(RequestError, match=r"temperature=1e-38 overflow") as e:
        llm.generate(prompts, max_new_tokens=4, temperature=1e-38, ignore_eos=True)
    assert "Fix:" in str(e.value) and "temperature=0" in str(e.value)
    assert _all_pages_free(llm)
    assert all(len(c.token_ids) == 4 for c in llm.generate(prompts, max_new_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("kwargs", [dict(temperature=1e39), dict(repetition_penalty=1e300)])
def test_sampling_values_beyond_float32_are_refused_before_work(llm, monkeypatch, kwargs):
    monkeypatch.setattr(llm.engine, "generate", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(RequestError, match=f"{next(iter(kwargs))}=.* beyond float32"):
        llm.generate([[5, 6, 7]], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("act", ["gelu", "relu", "made_up"])
def test_unknown_llama_activation_is_refused(tiny_dir, tmp_path, no_weights, act):
    with pytest.raises(ModelLoadError, match=f"hidden_act='{act}'") as e:
        attnzoo.load_model(_with_config(tiny_dir, tmp_path, hidden_act=act))
    assert "Fix:" in str(e.value)


def test_a_supported_other_llama_activation_runs_as_transformers(tmp_path):
    hf = tiny_llama(kv_heads=2, heads=4, layers=1)
    hf.config.hidden_act = "gelu_pytorch_tanh"
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf.config).eval()  # rebuilt: the MLP reads the activation at construction
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, backend="torch", page_size=16)
    assert_matches_hf(llm, hf, random_prompts(160, [6]), steps=4)


@pytest.mark.parametrize("arch, config, needle", [
    ("DeepseekV3ForCausalLM", lambda: DeepseekV3Config(**{**COMMON, "hidden_act": "gelu"}), "hidden_act='gelu'"),
    ("DeepseekV3ForCausalLM", lambda: DeepseekV3Config(**{**COMMON, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}), "rope_type='dynamic'"),
    ("DeepseekV3ForCausalLM", lambda: DeepseekV3Config(**{**COMMON, "max_position_embeddings": 0}),
     "max_position_embeddings"),
    ("Gemma4ForCausalLM", lambda: text_config(hidden_activation="silu"), "hidden_activation='silu'"),
    ("Gemma4ForCausalLM", lambda: _gemma_rope("longrope"), "rope_parameters.full_attention.rope_type='longrope'"),
    ("Gemma4ForCausalLM", lambda: text_config(max_position_embeddings=-1), "max_position_embeddings"),
])
def test_each_architecture_checks_the_keys_it_reads(arch, config, needle):
    with pytest.raises(ModelLoadError, match=needle.replace("[", r"\[")) as e:
        model_class(arch).shapes_only(config())
    assert "Fix:" in str(e.value)


def _gemma_rope(kind: str):
    cfg = text_config()
    cfg.rope_parameters[F] = {**cfg.rope_parameters[F], "rope_type": kind}
    return cfg


# ------------------------------------------------------------------------------ 7. positions, k/v scales


@pytest.mark.parametrize("value", [0, -4])
def test_max_position_embeddings_must_be_positive(tiny_dir, tmp_path, no_weights, value):
    with pytest.raises(ModelLoadError, match=f"max_position_embeddings must be a positive integer.*got {value}"):
        attnzoo.load_model(_with_config(tiny_dir, tmp_path, max_position_embeddings=value))


@pytest.mark.parametrize("kwargs", [dict(k_scale=0), dict(v_scale=-1.0), dict(k_scale=float("nan")),
                                    dict(v_scale=float("inf")), dict(k_scale="1"), dict(v_scale=True)])
def test_kv_scales_are_checked_before_the_weights(tiny_dir, no_weights, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ModelLoadError, match=f"{name} must be a positive finite number") as e:
        attnzoo.load_model(tiny_dir, **kwargs)
    assert "Fix:" in str(e.value)


# ------------------------------------------------------------------------------ 6. named errors


@pytest.mark.parametrize("prompt", ["w5 \ud800 w6", [{"role": "user", "content": "w5 \udcff"}],
                                    [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]])
def test_a_lone_surrogate_is_named(llm, monkeypatch, prompt):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }} {% endfor %}",
                        raising=False)
    with pytest.raises(RequestError, match="lone surrogate") as e:
        llm.generate([prompt], max_new_tokens=2)
    assert "Fix:" in str(e.value)


def test_chat_content_as_a_list_of_parts(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }} {% endfor %}",
                        raising=False)
    as_string = llm.generate([[{"role": "user", "content": "w5 w6\nw7"}]], max_new_tokens=3, ignore_eos=True)[0]
    parts = [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]  # joined with a newline
    as_parts = llm.generate([[{"role": "user", "content": parts}]], max_new_tokens=3, ignore_eos=True)[0]
    assert as_parts.prompt_token_ids == as_string.prompt_token_ids and as_parts.token_ids == as_string.token_ids
    for bad in ([{"type": "image_url", "image_url": {"url": "x.png"}}], ["w5"], [{"type": "text", "text": 5}]):
        with pytest.raises(RequestError, match="content part 0") as e:
            llm.generate([[{"role": "user", "content": bad}]], max_new_tokens=2)
        assert "text part" in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("template, kind", [
    ("{{ raise_exception('only user and assistant roles') }}", "TemplateError"),
    ("{% for m in messages %}{{ m['content'] ", "TemplateSyntaxError"),
    ("{{ messages[0]['content'] | no_such_filter }}", "TemplateAssertionError"),
    ("{{ messages[5]['content'].upper() }}", "UndefinedError"),
])
def test_a_chat_template_that_fails_is_named(llm, monkeypatch, template, kind):
    monkeypatch.setattr(llm.tokenizer, "chat_template", template, raising=False)
    with pytest.raises(RequestError, match=f"chat template failed.*{kind}") as e:
        llm.generate([[{"role": "user", "content": "w5"}]], max_new_tokens=2)
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize("rope", [{"rope_type": "no_such_rope", "rope_theta": 1e4},
                                  {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}])
def test_an_unsupported_rope_type_is_named(tiny_dir, tmp_path, no_weights, rope):
    with pytest.raises(ModelLoadError, match=f"rope_type='{rope['rope_type']}' is not supported") as e:
        attnzoo.load_model(_with_config(tiny_dir, tmp_path, rope_parameters=rope))
    assert "default" in str(e.value) and "Fix:" in str(e.value)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return save_checkpoint(tiny_v3(num_hidden_layers=2), tmp_path_factory.mktemp("val_dsv3"))


@pytest.mark.parametrize("extra, needle", [
    ({"model.layers.mtp.eh_proj.weight": torch.zeros(2, 2)}, "does not name a layer number"),
    ({"model.layers": torch.zeros(2)}, "does not name a layer number"),
    ({"model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)}, "names expert 8 of 8"),
    ({"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(32, 64)}, "makes a dense layer"),
    ({"model.layers.1.mlp.shared_experts.gate_proj.bias": torch.zeros(32)}, "has no matching parameter"),
])
def test_checkpoint_tensors_that_do_not_belong_are_named(v3_dir, tmp_path, extra, needle):
    d = tmp_path / "ck"
    shutil.copytree(v3_dir, d)
    save_file(extra, d / "extra.safetensors")
    with pytest.raises(WeightError, match=needle) as e:
        attnzoo.load_model(d, backend="torch", device="cpu")
    assert next(iter(extra)) in str(e.value) and "Fix:" in str(e.value)


def _gsm8k(d: Path, n_train: int = 6, n_test: int = 3) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        docs = [{"question": f"w{5 + i} w{6 + i}?", "answer": f"w{7 + i} #### {i}"} for i in range(n)]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return d


def test_gsm8k_file_that_is_not_utf8(tmp_path):
    from attnzoo.evals.tasks import check_data_dir

    d = _gsm8k(tmp_path / "data")
    (d / "test.jsonl").write_bytes('{"question": "caf\u00e9?", "answer": "1 #### 1"}\n'.encode("latin-1"))
    with pytest.raises(EvalError, match="test.jsonl is not UTF-8") as e:
        check_data_dir("gsm8k", d)
    assert "Fix:" in str(e.value)


# ------------------------------------------------------------------------------ 4. --compare-to a saved report


@pytest.fixture(scope="module")
def eval_setup(tiny_dir, tmp_path_factory):
    pytest.importorskip("lm_eval")
    return str(tiny_dir), str(_gsm8k(tmp_path_factory.mktemp("val_gsm8k")))


def _argv(model, data, *more):
    return ["gsm8k", "--model", model, "--data-dir", data, "--limit", "2", "--num-fewshot", "1",
            "--max-new-tokens", "8", "--device", "cpu", *map(str, more)]


def _good_report(model) -> dict:
    rec = lambda i: {"doc_id": i, "prompt_hash": "ab", "target": "1", "answers": {"strict-match": "1"},  # noqa: E731
                     "correct": {"strict-match": True}, "response": "w5", "output_token_ids": [5, 6]}
    return {"format": 1, "run": {
        "model": model, "label": "torch", "decision": {"prefill_backend": "torch", "decode_backend": "torch", "page_size": 4},
        "settings": {"task": "gsm8k", "limit": 2, "num_fewshot": 1, "apply_chat_template": False, "max_new_tokens": 8,
                     "kv_cache_dtype": "auto"},
        "tasks": {"gsm8k": {"per_question": [rec(0), rec(1)]}}}}


def _break(rep: dict, path: str, value) -> dict:
    rep = copy.deepcopy(rep)
    keys = path.split("/")
    node = rep["run"]
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return rep


_DELETE = object()
_Q = "tasks/gsm8k/per_question"


@pytest.mark.parametrize("path, value, needle", [
    (f"{_Q}/0/correct", _DELETE, "correct must be an object"),
    (f"{_Q}/1/correct/strict-match", "yes", "correct.strict-match must be true or false"),
    (f"{_Q}/1/correct", {}, r"per_question\[1\] has no right/wrong score"),
    (f"{_Q}/0/doc_id", "0", "doc_id must be an integer"),
    (f"{_Q}/1/doc_id", 0, "repeats document 0"),
    (f"{_Q}/0/answers", None, "answers must be an object"),
    (f"{_Q}/0/output_token_ids", ["a"], "non-negative integer token ids"),
    (f"{_Q}/0/output_token_ids", [5, 10**6], "outside this model's vocabulary"),
    (f"{_Q}/1", "not a record", r"per_question\[1\] must be an object"),
    ("decision", _DELETE, "run.decision must be an object"),
    ("decision/page_size", 0, "page_size must be a positive integer"),
    ("decision/decode_backend", None, "decode_backend must be a backend name"),
    ("settings", [], "run.settings must be an object"),
    ("tasks", {}, "run.tasks is empty"),
])
def test_a_malformed_saved_report_is_refused_before_the_run(eval_setup, tmp_path, monkeypatch, path, value, needle):
    from attnzoo.evals import run_eval

    model, data = eval_setup
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(_break(_good_report(model), path, value)))
    with pytest.raises(EvalError, match=needle) as e:
        run_eval.run(run_eval.build_parser().parse_args(_argv(model, data, "--compare-to", saved)))
    assert "Fix:" in str(e.value)


def test_the_unbroken_report_gets_past_validation(eval_setup, tmp_path, monkeypatch):
    """The control of the test above: the same report, unbroken, reaches the model load."""
    from attnzoo.evals import run_eval

    model, data = eval_setup
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("validated")))
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(_good_report(model)))
    with pytest.raises(RuntimeError, match="validated"):
        run_eval.run(run_eval.build_parser().parse_args(_argv(model, data, "--compare-to", saved)))


@pytest.mark.parametrize("plot, needle", [("missing/c.png", "does not exist"), ("dir.png", "is a directory")])
def test_plot_path_is_checked_before_the_run(eval_setup, tmp_path, monkeypatch, plot, needle):
    from attnzoo.evals import run_eval

    model, data = eval_setup
    (tmp_path / "dir.png").mkdir()
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(EvalError, match=f"--plot .*{needle}"):
        run_eval.run(run_eval.build_parser().parse_args(
            _argv(model, data, "--compare-to", "torch", "--plot", tmp_path / plot)))


def test_too_few_gsm8k_documents_for_the_shots(eval_setup, tmp_path, monkeypatch):
    from attnzoo.evals import run_eval

    model, _ = eval_setup
    data = _gsm8k(tmp_path / "short", n_train=3)
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["gsm8k", "--model", model, "--data-dir", str(data), "--limit", "2", "--device", "cpu",
            "--max-new-tokens", "8", "--num-fewshot", "5"]
    with pytest.raises(EvalError, match="holds 3 document.*fewer than the 5 few-shot") as e:
        run_eval.run(run_eval.build_parser().parse_args(argv))
    assert "--num-fewshot 3" in str(e.value)


def test_chart_write_is_atomic(tmp_path):
    from attnzoo.evals.report import _write_atomically

    out = tmp_path / "c.png"
    out.write_bytes(b"previous chart")

    def half_then_full_disk(fh):
        fh.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        _write_atomically(out, half_then_full_disk)
    assert out.read_bytes() == b"previous chart" and [p.name for p in tmp_path.iterdir()] == ["c.png"]
    _write_atomically(out, lambda fh: fh.write(b"new"))
    assert out.read_bytes() == b"new" and oct(out.stat().st_mode & 0o777) == oct(0o644)


# ------------------------------------------------------------------------------ 6. Ctrl-C


def test_ctrl_c_in_generate_and_run_eval_is_one_line(monkeypatch, capsys):
    from attnzoo import cli
    from attnzoo.evals import run_eval

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    def exit_code(main, argv):
        try:
            return main(argv)
        except KeyboardInterrupt:  # escaping, it would stop the whole test session
            pytest.fail(f"KeyboardInterrupt escaped {main.__module__}.main")

    monkeypatch.setattr(attnzoo, "load_model", interrupt)
    assert exit_code(cli.main, ["generate", "hi"]) == 130
    monkeypatch.setattr(run_eval, "run", interrupt)
    assert exit_code(run_eval.main, ["gsm8k"]) == 130
    err = capsys.readouterr().err
    assert err.split() == ["attnzoo:", "interrupted", "run_eval:", "interrupted"]


# ------------------------------------------------------------------------------ fault battery: the command line


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, env=ENV, cwd=REPO, timeout=timeout)


def _one_error_line(res, code=2) -> str:
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == code, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Fix:" in lines[0], err[-2000:]
    return lines[0]


def test_cli_bad_config_and_undecodable_prompt(tiny_dir, tmp_path, capsys):
    """In process (a subprocess costs seconds of imports): the same main() `python -m attnzoo` runs."""
    from attnzoo import cli

    bad = _with_config(tiny_dir, tmp_path, hidden_act="gelu")
    # Bytes that are not UTF-8 on the command line reach Python as lone surrogates (surrogateescape).
    undecodable = os.fsdecode(b"w5 \xff w6")
    for argv, needle in ((["--model", str(bad), "hi"], "hidden_act='gelu'"),
                         (["--model", str(tiny_dir), "--no-chat", undecodable], "prompt 0 holds a lone surrogate")):
        assert cli.main(["generate", *argv]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0] and "Fix:" in lines[0], err


def test_cli_run_eval_malformed_report(eval_setup, tmp_path):
    model, data = eval_setup
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(_break(_good_report(model), f"{_Q}/0/correct", _DELETE)))
    res = _cli("attnzoo.evals.run_eval", *_argv(model, data, "--compare-to", saved))
    assert "per_question[0].correct" in _one_error_line(res)


def test_cli_ctrl_c_during_generate(tiny_dir):
    """A real SIGINT while the model generates: exit 130, one line, no traceback, within seconds."""
    proc = subprocess.Popen([sys.executable, "-m", "attnzoo", "generate", "--model", str(tiny_dir), "--no-chat",
                             "--max-new-tokens", "500", "w5 w6 w7"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=ENV, cwd=REPO)
    try:
        for line in proc.stderr:  # the backends line is printed once the model is loaded
            if line.startswith(b"# LlamaForCausalLM"):
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = rest.decode()
    assert proc.returncode == 130 and "Traceback" not in err and err.strip() == "attnzoo: interrupted", err[-2000:]
