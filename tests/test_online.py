"""The online engine admits a request that arrives while others decode at the next step, not when one of
them ends: a step launched ahead on the device tokens (early launch) never runs past a waiting arrival."""
import threading
import time

from transformers import LlamaConfig

import attnzoo
from attnzoo.engine.online import OnlineEngine
from attnzoo.engine.sampling import SamplingParams


def test_an_arrival_joins_the_running_batch_at_once():
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    cfg.architectures = ["LlamaForCausalLM"]
    llm = attnzoo.load_model(cfg, load_format="random", backend="torch", page_size=4, device="cpu")
    # Off by default on a CPU (each step runs on the host: a step launched early would hold back this step's
    # tokens for a whole step); on here, where the GPU's path is under test.
    assert (llm.engine.overlap, llm.engine.early_launch) == (False, False)
    llm.engine.overlap = llm.engine.early_launch = True
    online = OnlineEngine(llm)
    long = SamplingParams(max_new_tokens=1000, ignore_eos=True)
    counts = {"a": 0}
    five, first = threading.Event(), threading.Event()
    seen_at = {}

    def on_a(ev):
        counts["a"] += ev.token is not None
        if counts["a"] == 5:
            five.set()

    def on_c(ev):
        if ev.token is not None and not first.is_set():
            seen_at["a"] = counts["a"]
            first.set()

    try:
        a = online.submit([5, 6, 7], long, on_a)
        online.submit([8, 9], long)
        assert five.wait(60)
        at_submit = counts["a"]
        time.sleep(0.02)  # several steps run with the arrival waiting if it is not admitted
        submitted = counts["a"]
        online.submit([10, 11, 12], SamplingParams(max_new_tokens=3, ignore_eos=True), on_c)
        assert first.wait(60)
        assert not a.done, "the long requests ended before the arrival started: the test proves nothing"
        # its first token within a few steps of the arrival (prefill, then sampled in that step)
        assert seen_at["a"] - submitted <= 3, (at_submit, submitted, seen_at)
    finally:
        online.shutdown(drain=False)
        llm.close()


def test_warm_up_runs_cascade_once_and_restores_the_thresholds():
    """`attnzoo serve` warms up before it answers: a cascade step ran (its kernels built), and the runner's
    cascade thresholds are the load's again afterwards."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    cfg.architectures = ["LlamaForCausalLM"]
    llm = attnzoo.load_model(cfg, load_format="random", backend="triton", page_size=4, device="cpu", cascade=True)
    runner = llm.engine.runner
    before = runner.cascade_min_saved_tokens, runner.cascade_graph_min_saved_tokens
    handed = []  # the backends' own warm-up (paths only large steps take) gets the model's attention layers
    real = llm.engine.backends.warm_up
    llm.engine.backends.warm_up = lambda layers: handed.append(layers) or real(layers)
    stats = llm.warm_up()
    assert stats["cascade"] >= 1, stats
    assert [[layer.layer_id for layer in layers] for layers in handed] == [[0]]
    assert (runner.cascade_min_saved_tokens, runner.cascade_graph_min_saved_tokens) == before
    assert llm.engine.allocator.num_free + llm.engine.prefix_cache.evictable() == llm.engine.allocator.capacity


def test_attnzoo_serve_warms_up_then_answers_and_drains_on_sigterm(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "attnzoo", "serve", str(tmp_path), "--load-format", "random",
                             "--backend", "torch", "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else "no /health"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    assert "kernels warmed up" in err and proc.returncode in (0, -signal.SIGTERM), err
