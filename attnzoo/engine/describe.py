"""What ``LLM.info()`` says of a loaded model's cascade path and KV page groups, in words and numbers: why each is
on or off, split or not, read from the engine and the pool as they were built."""
from __future__ import annotations

from attnzoo.attention.kv_cache import KVPool


def cascade_state(e) -> str:
    """Whether and when the engine ``e``'s steps read a shared prefix once (cascade), or why not."""
    scope = f" ({e.prefill_backend.cascade_extend_scope})" if e.prefill_backend.cascade_extend_scope else ""
    if e.cascade:
        graphs = e.graphs is not None and e.graphs.cascade
        when = (f"as CUDA graphs when shared tokens x (requests - 1) >= {e.cascade_graph_min_saved_tokens}, "
                f"eagerly when >= {e.cascade_min_saved_tokens} and no graph serves the step" if graphs else
                f"when shared tokens x (requests - 1) >= {e.cascade_min_saved_tokens}; such steps run eagerly")
        shared_pass = e.decode_backend.cascade_shared_pass
        return (f"on: decode steps whose requests share >= 1 page read it once ({when}"
                + (f"; {shared_pass}" if shared_pass else "") + ")"
                + (f"; extend steps too{scope}" if e.cascade_extend else ""))
    if e.prefix_cache is None:
        return "off: prefix caching is off"
    if not e.decode_backend.supports_cascade:
        # trtllm_mha off Blackwell: its prefill is the flashinfer backend, which cascades extend steps
        extend = f"; extend steps: on (prefill backend {e.prefill_backend.name!r}){scope}" if e.cascade_extend else ""
        return f"off: decode backend {e.decode_backend.name!r} has no cascade path" + extend
    return "off: turned off (cascade=False)"


def page_groups(pool: KVPool, e, specs, window_kv_fraction) -> dict:
    """The pool's page groups: capacity, layers and bytes per token of each, and why it is split or not
    (``specs``: the model's KV cache specs; ``window_kv_fraction``: as load_model was given it)."""
    ps = pool.page_size

    def group(name: str, alloc) -> dict:
        layers = [i for i in range(len(specs)) if specs[i] is not None and pool.in_window_group(i) == (name == "window")]
        return {"pages": alloc.capacity, "tokens": alloc.capacity * ps, "layers": len(layers),
                "kv_bytes_per_token": KVPool.bytes_per_token(specs, ps, pool.kv_dtype, group=name)}

    if not pool.has_window_group:
        windows = {s.sliding_window for s in specs if s is not None and s.sliding_window}
        why = ("one group: no layer has a sliding window" if not windows else
               "one group: window_kv_fraction=None" if window_kv_fraction is None else
               "one group: window_kv_fraction='auto' splits only models whose layers compress their keys"
               if window_kv_fraction == "auto" and e.context_len > max(windows) else
               f"one group: the context ({e.context_len}) fits the sliding window ({max(windows)})")
        return {"explain": why, "window_kv_fraction": None, "full": group("full", e.allocator)}
    return {
        "explain": (f"two groups in one buffer: the {group('window', e.window_allocator)['layers']} sliding-window "
                    f"layers keep only the pages their window ({pool.window} tokens) can still see, in their own "
                    f"pages ('window'); the others keep every token ('full'). window_kv_fraction="
                    f"{window_kv_fraction!r} sizes the window group ('auto': for max_running decoding requests' "
                    "windows and one prefill chunk; a number: in tokens per full-group token); kv_cache_tokens "
                    "counts the full group. A request reserves prompt + max_new_tokens in 'full' and at most its "
                    "window + a page + its largest prefill chunk in 'window'"),
        "window_kv_fraction": window_kv_fraction,
        "window": pool.window,
        "full": group("full", e.allocator),
        "window_group": group("window", e.window_allocator),
    }


def whole_steps(runner) -> list:
    """[the most prompt chunks a mixed step captured whole may hold, or None; why] (``engine.mixed_graphs``)."""
    if runner.mixed is None:
        return [None, runner.mixed_why]
    return [runner.mixed.max_chunks, f"mixed steps of up to {runner.mixed.max_tokens} tokens replay one graph each, "
            f"attention inside (captured in {runner.mixed.capture_s:.2f} s); steps with a shared prefix or more "
            "chunks run as pieces"]
