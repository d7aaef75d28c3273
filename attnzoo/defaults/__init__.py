"""The attention-backend policy: capabilities, the policy table, and ``resolve``.

``resolve(hf_config, gpu=..., overrides=Overrides(...), model_id=...) -> Decision`` decides the prefill
backend, the decode backend and the KV page size, and explains why (``Decision.explain()``,
``Decision.to_dict()``). ``attnzoo policy show|explain`` is the command-line face (``defaults/cli.py``).
"""
from attnzoo.attention.backends.capabilities import GPUS, BackendCapabilities, Kernel, check_backend
from attnzoo.defaults.profile import ModelProfile, profile_from_config
from attnzoo.defaults.resolve import (
    POLICY_ENV,
    Candidate,
    Decision,
    Overrides,
    Source,
    detect_gpu,
    gpu_class,
    resolve,
)
from attnzoo.defaults.table import SHIPPED_POLICY, PolicyTable, load_table

__all__ = [
    "GPUS", "BackendCapabilities", "Kernel", "check_backend",
    "ModelProfile", "profile_from_config",
    "POLICY_ENV", "Candidate", "Decision", "Overrides", "Source", "detect_gpu", "gpu_class", "resolve",
    "SHIPPED_POLICY", "PolicyTable", "load_table",
]
