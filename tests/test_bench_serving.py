"""benchmarks/bench_serving.py's prompts and serve_peer.py's scenarios: no measured prompt is one the server
saw before (the warm-up's, or an earlier scenario's), or its TTFT would time a prefix-cache hit."""
import argparse


def _args(**kw):
    base = dict(dataset="random", seed=0, warmup=2, num_prompts=5, input_len=8, output_len=4, min_token_id=10,
                vocab_size=1000, first_question=0)
    return argparse.Namespace(**{**base, **kw})


def test_warm_up_prompts_are_not_measured_ones(bench_script):
    bs = bench_script("bench_serving")
    prompts = [tuple(p) for p, _ in bs.make_prompts(_args())]
    assert len(prompts) == 7 and len(set(prompts)) == 7
    other = {tuple(p) for p, _ in bs.make_prompts(_args(seed=1))}
    assert not other & set(prompts)
    gsm = bs.make_prompts(_args(dataset="gsm8k", gsm8k_tokens=str(bs.GSM8K_TOKENS), first_question=10))
    later = bs.make_prompts(_args(dataset="gsm8k", gsm8k_tokens=str(bs.GSM8K_TOKENS), first_question=17))
    assert len({tuple(p) for p, _ in gsm + later}) == 14  # questions 10..16, then 17..23


def test_serve_peer_scenarios_draw_disjoint_prompts(bench_script, monkeypatch):
    bs, peer = bench_script("bench_serving"), bench_script("serve_peer")
    seen = []

    async def fake_run(ns):
        seen.append(ns)
        return [], 1.0

    monkeypatch.setattr(bs, "run", fake_run)
    monkeypatch.setattr(bs, "summarize", lambda ns, results, wall: {})
    monkeypatch.setattr(bs, "table", lambda rows: "row")
    peer.measure("attnzoo", argparse.Namespace(port=1, input_len=8, output_len=4, prompts_scale=0.05, shape="llama8b"),
                 "m")
    assert len(seen) == len(peer.SCENARIOS["llama8b"])
    sent = [{tuple(p) for p, _ in bs.make_prompts(ns)} for ns in seen]
    for i in range(len(sent)):
        for j in range(i):
            assert not sent[i] & sent[j], (seen[i].dataset, seen[j].dataset)


def test_serve_peer_runs_only_the_scenarios_asked_for_with_their_full_run_prompts(bench_script, monkeypatch):
    bs, peer = bench_script("bench_serving"), bench_script("serve_peer")
    seen, phase = {"all": [], "some": []}, ["all"]

    async def fake_run(ns):
        seen[phase[0]].append(ns)
        return [], 1.0

    monkeypatch.setattr(bs, "run", fake_run)
    monkeypatch.setattr(bs, "summarize", lambda ns, results, wall: {})
    monkeypatch.setattr(bs, "table", lambda rows: "row")
    monkeypatch.setattr(peer, "server_ttft", lambda url: None)
    for phase[0], wanted in (("all", []), ("some", ["gsm8k_c1", "random_c1"])):
        peer.measure("attnzoo", argparse.Namespace(port=1, input_len=8, output_len=4, prompts_scale=0.05,
                                                   shape="llama8b", scenarios=wanted), "m")
    key = lambda ns: (ns.dataset, ns.max_concurrency, ns.first_question, ns.seed)  # noqa: E731
    assert [key(ns) for ns in seen["some"]] == [key(ns) for ns in seen["all"] if ns.max_concurrency == 1]
    assert len(seen["all"]) == len(peer.SCENARIOS["llama8b"]) and len(seen["some"]) == 2


def test_serve_peer_refuses_a_scenario_the_shape_does_not_have(bench_script, capsys):
    import pytest

    peer = bench_script("serve_peer")
    with pytest.raises(SystemExit):
        peer.main(["--out", "/tmp/x", "--shape", "llama8b", "--scenarios", "random_c1, random_c64"])
    assert "random_c64" in capsys.readouterr().err


def test_online_load_runs_the_closed_loop_and_splits_steps_by_kind(bench_script, monkeypatch, tmp_path):
    """online_load.py on a tiny Llama (CPU): every request finishes with its tokens, and the step log splits
    into decode-only steps and steps with prompt chunks that hold every prompt token once."""
    import json

    import transformers

    online_load, e2e = bench_script("online_load"), bench_script("e2e")

    def tiny(shape, layers):
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        config.architectures = ["LlamaForCausalLM"]
        return config, {}

    monkeypatch.setattr(e2e, "make_config", tiny)
    path = tmp_path / "load.json"
    assert online_load.main(["--input-len", "40", "--output-len", "6", "--num-prompts", "10", "--max-concurrency", "3",
                             "--vocab-size", "500", "--load-kwargs", '{"dtype": "float32"}', "--out", str(path)]) == 0
    res = json.loads(path.read_text())["result"]
    assert res["errors"] == [] and res["output_tok_per_s"] > 0
    steps = res["steps"]
    new_tokens = sum(k["steps"] * k["new_tokens_per_step"] for k in steps.values())
    assert abs(new_tokens - 10 * (40 + 5)) < 1e-6  # each prompt once with its first token, then 5 decode tokens
    assert steps["decode"]["rows_per_step"] <= 3  # the closed loop holds 3 requests at most
    assert steps["mixed"]["steps"] >= 4  # the 3 first prompts, then one per finished request at least
    assert sum(k["s"] for k in steps.values()) <= res["wall_s"] + 1e-3
    for k in steps.values():  # the host's work and its wait for the tokens fit in the step's time
        assert k["host_ms_per_step"] > 0 and k["wait_ms_per_step"] >= 0
        assert k["host_ms_per_step"] + k["wait_ms_per_step"] <= k["ms_per_step"] + 2e-2  # three roundings


def test_serve_peer_names_modules_that_are_present_but_do_not_import(bench_script, tmp_path):
    """A serving package can be on the path and still fail on one it imports (fastapi 0.165 without
    opentelemetry): the check imports each module, and says what stopped it."""
    import os

    peer = bench_script("serve_peer")
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_xyz\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    missing = peer.missing_modules(["json", "needs_more", "no_such_module_xyz"], env)
    assert [m.split()[0] for m in missing] == ["needs_more", "no_such_module_xyz"]
    assert "no_such_dependency_xyz" in missing[0] and "ModuleNotFoundError" in missing[1]


def test_serve_peer_stops_a_starting_server_when_it_is_terminated(tmp_path):
    """A server runs in a session of its own: when serve_peer gets a timeout's SIGTERM while the server starts,
    the server is stopped too (a timed-out run once left vLLM holding most of a GPU for the next job)."""
    import os, signal, subprocess, sys, time
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    pid_file = tmp_path / "server.pid"
    child = f"""
import signal, sys
sys.path.insert(0, {str(bench)!r})
import serve_peer
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # what serve_peer.py installs when run as a script
server = [sys.executable, "-c", "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
serve_peer.start("fake", server, None, {str(tmp_path / 'log')!r}, port=9, timeout=120)
"""
    proc = subprocess.Popen([sys.executable, "-c", child])
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 143
    try:
        os.kill(server_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_serve_peer_a_server_that_exits_is_a_start_failure_the_run_goes_on_from(bench_script, tmp_path):
    """A server that dies while starting raises StartFailed (main goes on to the other server); a SIGTERM's
    SystemExit is not one, so main stops instead of starting the next server."""
    import sys
    import pytest
    sp = bench_script("serve_peer")
    with pytest.raises(sp.StartFailed, match="exited with 3"):
        sp.start("fake", [sys.executable, "-c", "raise SystemExit(3)"], None, tmp_path / "log", port=9, timeout=60)
    assert not issubclass(sp.StartFailed, SystemExit)
