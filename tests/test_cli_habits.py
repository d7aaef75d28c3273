"""The command line's habits, through ``python -m attnzoo`` as a user runs it: --version, help without markup,
human output with --json beside it, chat only where the tokenizer has a template, the API's sampling options."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnzoo import load_model
from attnzoo.cli import main
from tests.helpers import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
CHAT = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
LOAD = ["--device", "cpu", "--dtype", "float32", "--backend", "torch"]


def run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "attnzoo", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def _checkpoint(path: Path, template: str | None) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = tiny_tokenizer(VOCAB)
    if template:
        tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("plain"), None)


@pytest.fixture(scope="module")
def chatty(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("chatty"), CHAT)


def test_version_and_help_without_markup(capsys):
    got = run("--version")
    assert got.returncode == 0 and got.stdout.strip().startswith("attnzoo 0.")
    for args in (["--help"], ["generate", "--help"], ["tune", "--help"], ["policy", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
        out = capsys.readouterr().out
        assert "usage: attnzoo" in out and "`" not in out, args


def test_plain_text_without_a_template_and_json_lines(plain):
    llm = load_model(plain, device="cpu", dtype="float32", backend="torch")
    want = llm.generate("w5 w9 w17", max_new_tokens=6, ignore_eos=True, repetition_penalty=1.5)[0]
    got = run("generate", "--model", plain, *LOAD, "--max-new-tokens", "6", "--ignore-eos", "--repetition-penalty", "1.5",
              "--json", "w5 w9 w17")
    assert got.returncode == 0, got.stderr
    line = json.loads(got.stdout)
    assert (line["chat"], line["text"], line["num_tokens"]) == (False, want.text, 6)


def test_human_output_by_default(plain, capsys):
    llm = load_model(plain, device="cpu", dtype="float32", backend="torch")
    want = llm.generate("w5 w9 w17", max_new_tokens=6, ignore_eos=True)[0]
    assert main(["generate", "--model", plain, *LOAD, "--max-new-tokens", "6", "--ignore-eos", "w5 w9 w17"]) == 0
    assert capsys.readouterr().out.startswith("### w5 w9 w17\n" + want.text + "\n[length, 6 tokens]")
    assert main(["generate", "--model", plain, *LOAD, "--chat", "w5"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "drop --chat" in err


def test_chat_where_a_template_is_and_several_samples(chatty):
    llm = load_model(chatty, device="cpu", dtype="float32", backend="torch")
    want = llm.generate([[{"role": "user", "content": "w5 w9"}]], max_new_tokens=5, ignore_eos=True)[0]
    got = run("generate", "--model", chatty, *LOAD, "--max-new-tokens", "5", "--ignore-eos", "--json", "w5 w9")
    assert got.returncode == 0, got.stderr
    line = json.loads(got.stdout)
    assert line["chat"] is True and line["text"] == want.text

def test_several_samples_without_chat(chatty, capsys):
    assert main(["generate", "--model", chatty, *LOAD, "--max-new-tokens", "4", "--ignore-eos", "-n", "3",
                 "--temperature", "1.0", "--seed", "2", "--no-chat", "--json", "w5 w9"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2] and all(x["num_tokens"] == 4 and not x["chat"] for x in lines)


def test_info_is_human_by_default_and_json_on_request(plain, capsys):
    assert main(["info", "--model", plain, *LOAD, "--k-scale", "0.5"]) == 0
    human = capsys.readouterr().out
    assert "kv_cache_tokens" in human and not human.lstrip().startswith("{")
    assert main(["info", "--model", plain, *LOAD, "--json", "--k-scale", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_scales"]["k_scale"] == 0.5


def test_serve_refuses_a_negative_graph_extend_tokens_before_loading(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    assert main(["serve", "no/such-model", "--graph-extend-tokens", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--graph-extend-tokens -1" in err and "no/such-model" not in err  # refused before the model was looked up
