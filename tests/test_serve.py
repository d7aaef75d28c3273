"""`attnzoo serve` on CPU: a real server on 127.0.0.1 (uvicorn in a thread) over a tiny random Llama,
driven by the openai client and lm-eval's local-completions, checked against ``generate()`` of a second
instance of the same model (greedy)."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import uvicorn  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.server.app import create_app  # noqa: E402

KEY = "sk-test"
REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _char_tokenizer():
    """One token per character: any text is a prompt, any output decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: i + 3 for i, c in enumerate([chr(i) for i in range(32, 127)] + ["\n"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out


def _load(path):
    return attnzoo.load_model(path, backend="torch", page_size=4, device="cpu", dtype="float32", kv_cache_tokens=1024,
                              max_batch_tokens=512)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.2)
    path = tmp_path_factory.mktemp("serve_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    llm, ref = _load(path), _load(path)
    app = create_app(llm, model_name="tiny", api_key=KEY, max_queue=1024)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    yield SimpleNamespace(url=url, llm=llm, ref=ref, app=app, path=str(path),
                          client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0))
    server.should_exit = True
    thread.join(30)


def _http(srv, method: str, path: str, body=None, *, key: bool = True):
    """(status, headers, JSON body) of one plain HTTP request (``body``: bytes, or an object sent as JSON)."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {KEY}"} if key else {})}
    conn.request(method, path, body if body is None or isinstance(body, bytes) else json.dumps(body), headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def _json(data: bytes):
    return json.loads(data)


def _greedy(ref, prompts, n):
    return [c.text for c in ref.generate(prompts, max_new_tokens=n, ignore_eos=True)]


def _pages_all_free(llm) -> bool:
    e = llm.engine
    return e.allocator.num_free + e.prefix_cache.evictable() == e.allocator.capacity


def test_completions_and_chat_match_generate(srv):
    c = srv.client
    prompts = ["Tom has 3 apples", "The sky is", "x"]
    want = _greedy(srv.ref, prompts, 12)
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(prompt=prompts, **kw)
    assert [ch.text for ch in sorted(plain.choices, key=lambda ch: ch.index)] == want
    assert plain.usage.completion_tokens == 36
    for p, w in zip(prompts, want):
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(prompt=p, stream=True, **kw))
        assert streamed == w
    msgs = [{"role": "user", "content": "Hello there"}]
    (want_chat,) = _greedy(srv.ref, [msgs], 12)
    chat = c.chat.completions.create(messages=msgs, **kw)
    assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(messages=msgs, stream=True, **kw))
    assert streamed == want_chat
    # n choices of one prompt, and a stop string cutting the text as generate() cuts it
    two = c.completions.create(prompt=prompts[0], n=2, **kw)
    assert [ch.text for ch in two.choices] == [want[0]] * 2
    stop = want[0][3:5]
    cut = c.completions.create(prompt=prompts[0], stop=[stop], **kw).choices[0]
    assert cut.text == srv.ref.generate(prompts[0], max_new_tokens=12, ignore_eos=True, stop=stop)[0].text
    assert cut.finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(prompt=prompts[0], stop=[stop], stream=True, **kw))
    assert streamed == cut.text


def test_logprobs_and_echo_match_the_models_logits(srv):
    c = srv.client
    prompt = "Tom has 3 apples"
    ids = srv.ref.tokenizer.encode(prompt)
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    gen = srv.ref.generate(prompt, max_new_tokens=4, ignore_eos=True)[0].token_ids
    logp = torch.log_softmax(srv.ref.logits(ids + gen[:-1]), -1)
    want = [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(gen)]
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 2 for top in out.choices[0].logprobs.top_logprobs)
    # lm-eval's loglikelihood request: echo with max_tokens 0 gives the prompt's logprobs only
    echo = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0).choices[0]
    logp = torch.log_softmax(srv.ref.logits(ids), -1)
    assert echo.text == prompt and echo.logprobs.token_logprobs[0] is None
    assert echo.logprobs.token_logprobs[1:] == pytest.approx([logp[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                             abs=1e-4)


def test_200_concurrent_requests_give_their_one_at_a_time_outputs(srv):
    prompts = [f"Question {i}: {'ab' * (i % 7)} is" for i in range(200)]
    lengths = [1 + i % 6 for i in range(200)]
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

    async def one(p, n):
        r = await client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def all_at_once():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    got = asyncio.run(all_at_once())
    want = [srv.ref.generate(p, max_new_tokens=n, ignore_eos=True)[0].text for p, n in zip(prompts, lengths)]
    assert got == want


def test_client_disconnect_mid_stream_frees_its_pages(srv):
    online = srv.app.state.online
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 900, "stream": True, "ignore_eos": True}
    before = srv.llm.engine.generated_tokens
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    first = [r.fp.readline() for _ in range(4)]
    assert any(line.startswith(b"data: {") for line in first)
    assert online.num_running() == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while (online.num_running() or not _pages_all_free(srv.llm)) and time.time() < deadline:
        time.sleep(0.05)
    assert online.num_running() == 0 and _pages_all_free(srv.llm)
    assert srv.llm.engine.generated_tokens - before < 900  # cancelled, not run to its end


def test_bad_requests_get_openai_errors(srv):
    status, _, data = _http(srv, "POST", "/v1/completions", b"{not json")
    assert status == 400 and _json(data)["error"]["type"] == "invalid_request_error"
    status, _, data = _http(srv, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and _json(data)["error"]["code"] == "model_not_found"
    status, _, data = _http(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": "a" * 2100})
    assert status == 400 and _json(data)["error"]["code"] == "context_length_exceeded"
    status, _, data = _http(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": "a" * 500, "max_tokens": 1000})
    assert status == 400 and "KV pages" in _json(data)["error"]["message"]  # beyond the 1024-token cache
    status, _, data = _http(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"}, key=False)
    assert status == 401 and _json(data)["error"]["code"] == "invalid_api_key"
    assert _http(srv, "GET", "/v1/models", key=False)[0] == 401
    assert _json(_http(srv, "GET", "/v1/models")[2])["data"][0]["id"] == "tiny"
    assert _json(_http(srv, "GET", "/health")[2]) == {"status": "ok"}
    online = srv.app.state.online
    online.max_queue = 0
    try:
        status, headers, data = _http(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})
    finally:
        online.max_queue = 1024
    assert status == 503 and headers["retry-after"] == "1" and "error" in _json(data)


def test_metrics_parse_as_prometheus_text(srv):
    from prometheus_client.parser import text_string_to_metric_families

    srv.client.completions.create(model="tiny", prompt="warm", max_tokens=3, temperature=0)
    text = _http(srv, "GET", "/metrics", key=False)[2].decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("attnzoo_requests_waiting", "attnzoo_requests_running", "attnzoo_kv_pages_in_use",
                 "attnzoo_prefix_cache_hit_rate", "attnzoo_time_to_first_token_seconds",
                 "attnzoo_time_per_output_token_seconds", "attnzoo_inter_token_latency_seconds",
                 "attnzoo_generation_tokens_per_second", "attnzoo_engine_step_seconds",
                 "attnzoo_engine_step_host_seconds", "attnzoo_engine_step_tokens"):
        assert name in fams, name
    count = next(s.value for s in fams["attnzoo_time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert count >= 1
    steps = {s.labels["kind"]: s.value for s in fams["attnzoo_engine_step_seconds"].samples if s.name.endswith("_count")}
    assert steps["prompt"] >= 1 and steps["decode"] >= 1  # the request's prompt step, then its decode steps


def test_serve_peer_reads_the_servers_own_ttft(srv, bench_script):
    """serve_peer.py's scrape of /metrics: one more request adds one to the count and its TTFT to the sum."""
    peer = bench_script("serve_peer")
    before = peer.server_ttft(srv.url) or (0.0, 0.0)
    srv.client.completions.create(model="tiny", prompt="ttft", max_tokens=2, temperature=0)
    after = peer.server_ttft(srv.url)
    assert after[1] == before[1] + 1 and 0 < after[0] - before[0] < 60
    assert peer.server_ttft("http://127.0.0.1:9") is None  # nothing listens there: no number, no error


def test_serve_peer_counts_the_engine_steps_by_kind(srv, bench_script):
    """serve_peer.py's step counts: a 3-token request is one prompt step (its first token) and two decode steps of
    one row, a token each."""
    peer = bench_script("serve_peer")
    before = peer.server_steps(srv.url)
    srv.client.completions.create(model="tiny", prompt="steps", max_tokens=3, temperature=0)
    got = peer.step_delta(before, peer.server_steps(srv.url))
    assert got["prompt"]["steps"] == 1 and got["prompt"]["tokens"] >= 1
    assert got["decode"]["steps"] == got["decode"]["tokens"] == 2
    assert 0 <= got["decode"]["host_s"] <= got["decode"]["s"] and got["decode"]["ms_mean"] > 0
    assert peer.server_steps("http://127.0.0.1:9") is None and peer.step_delta(None, None) is None


def test_bench_serving_reads_the_server_after_its_warm_up(srv, bench_script):
    """serve_peer's server TTFT counts only the measured requests: the hook runs once the warm-up's are done."""
    import argparse

    bs, peer = bench_script("bench_serving"), bench_script("serve_peer")
    before = peer.server_ttft(srv.url) or (0.0, 0.0)
    snap = []
    ns = argparse.Namespace(base_url=srv.url, model="tiny", api_key=KEY, dataset="random", input_len=8, output_len=3,
                            num_prompts=2, vocab_size=100, min_token_id=3, max_concurrency=1, request_rate=float("inf"),
                            warmup=3, seed=7, after_warmup=lambda: snap.append(peer.server_ttft(srv.url)))
    results, _ = asyncio.run(bs.run(ns))
    assert all(r.ok for r in results) and len(results) == 2
    assert snap[0][1] == before[1] + 3 and peer.server_ttft(srv.url)[1] == before[1] + 5


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason=f"GSM8K files not found at {GSM8K_DIR}")
def test_lm_eval_local_completions_matches_the_in_process_route(srv, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    import lm_eval

    from attnzoo.evals.lm import AttnzooLM
    from attnzoo.evals.tasks import check_data_dir, load_tasks

    def answers(model, **kw):
        tm, tasks = load_tasks("gsm8k", check_data_dir("gsm8k", str(GSM8K_DIR)))
        res = lm_eval.simple_evaluate(model=model, tasks=list(tasks["tasks"].values()), limit=10, num_fewshot=0,
                                      gen_kwargs={"max_gen_toks": 6}, task_manager=tm, log_samples=True, **kw)
        return {s["doc_id"]: s["resps"][0][0] for s in res["samples"]["gsm8k"]}  # one per filter, the same resps

    local = answers(AttnzooLM(llm=srv.ref, pretrained=srv.path))
    served = answers("local-completions", model_args=(
        f"model=tiny,base_url={srv.url}/v1/completions,tokenizer={srv.path},tokenizer_backend=huggingface,"
        f"num_concurrent=10,max_length=2048,max_retries=1"))
    assert len(local) == 10 and served == local
