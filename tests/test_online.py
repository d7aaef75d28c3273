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
