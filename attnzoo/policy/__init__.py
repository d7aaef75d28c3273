"""The attention-backend policy: the table (policy.toml), the model's attention profile, and ``resolve``,
whose Decision holds every choice with its reasons; ``attnzoo policy`` in attnzoo/cli.py prints them."""
from attnzoo.attention.backends.capabilities import GPUS, BackendCapabilities, Kernel, check_backend
from attnzoo.policy.profile import ModelProfile, profile_from_config, rank_local
from attnzoo.policy.resolve import POLICY_ENV, Candidate, Decision, Overrides, Source, detect_gpu, gpu_class, resolve
from attnzoo.policy.table import SHIPPED_POLICY, PolicyTable, load_table

__all__ = ["GPUS", "BackendCapabilities", "Kernel", "check_backend", "ModelProfile", "profile_from_config", "rank_local",
           "POLICY_ENV", "Candidate", "Decision", "Overrides", "Source", "detect_gpu", "gpu_class", "resolve",
           "SHIPPED_POLICY", "PolicyTable", "load_table"]
