"""The project's exception types. Every message names the problem and, where there is one, the fix."""
from __future__ import annotations


class AttnzooError(Exception):
    """Base class. ``fix`` is appended to the message as 'Fix: ...'."""

    def __init__(self, problem: str, *, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem}. Fix: {fix}")


class ModelLoadError(AttnzooError):
    """The checkpoint cannot be found, read or mapped onto the model."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture attnzoo does not implement."""


class WeightError(ModelLoadError):
    """A weight tensor is missing, unexpected or mis-shaped."""


class BackendError(AttnzooError):
    """An attention backend cannot run here: unknown, not installed, or the GPU/shape is unsupported."""


class PolicyError(AttnzooError):
    """A policy file or override is malformed, or an explicit choice violates a constraint."""


class RequestError(AttnzooError):
    """A generation request is invalid: empty, too long for the context, bad sampling parameters."""


class KVCacheFullError(AttnzooError):
    """The KV cache cannot hold what was asked of it."""


class NumericsError(AttnzooError):
    """The model produced non-finite values (NaN or inf) while generating."""


class EvalError(AttnzooError):
    """An evaluation run is misconfigured (task, data, output path, limit)."""


class QueueFullError(AttnzooError):
    """The server's request queue is full, or the server is shutting down: retry later."""
