"""Triton kernels over the paged KV cache, shared by every backend.

Importing this package imports triton. On a CPU the kernels run under Triton's interpreter, which must
be switched on (``TRITON_INTERPRET=1``) before these modules are first imported.

* ``decode``: paged decode attention, split-K, GQA-grouped (``decode_attention``).
* ``extend``: paged causal prefill over a cached prefix (``extend_attention``).
* ``store``: writing new k/v rows at their slots (``store_kv``; ``KVPool.store`` uses it on CUDA).
* ``page_table``: ragged page indices / padded block tables for FlashInfer- and TRT-LLM-style kernels.
"""
