"""The attention-backend policy: the policy table, the model's attention profile, and ``resolve``.

``resolve(hf_config, gpu=..., overrides=Overrides(...), model_id=...) -> Decision`` decides the prefill
backend, the decode backend and the KV page size, and holds why (``Decision.explain()``, ``to_dict()``).
``attnzoo policy show|explain|backends`` is the command-line face (attnzoo/cli.py).
"""
from attnzoo.attention.backends.capabilities import GPUS, BackendCapabilities, Kernel, check_backend
from attnzoo.policy.profile import ModelProfile, profile_from_config, rank_local
from attnzoo.policy.resolve import POLICY_ENV, Candidate, Decision, Overrides, Source, detect_gpu, gpu_class, resolve
from attnzoo.policy.table import SHIPPED_POLICY, PolicyTable, load_table

__all__ = [
    "GPUS", "BackendCapabilities", "Kernel", "check_backend", "ModelProfile", "profile_from_config", "rank_local",
    "POLICY_ENV", "Candidate", "Decision", "Overrides", "Source", "detect_gpu", "gpu_class", "resolve",
    "SHIPPED_POLICY", "PolicyTable", "load_table",
]
