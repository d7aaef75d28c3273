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


class DistributedError(AttnzooError):
    """A rank of a tensor- or data-parallel group failed (``rank``, ``exitcode`` where known), or the group is
    closed or broken: every later call on it raises this too."""

    def __init__(self, problem: str, *, fix: str | None = None, rank: int | None = None, exitcode: int | None = None):
        super().__init__(problem, fix=fix)
        self.rank, self.exitcode = rank, exitcode

    def __reduce__(self):  # the keyword-only arguments survive pickling (a rank re-raises rank 0's error)
        return _rebuild_distributed_error, (self.problem, self.fix, self.rank, self.exitcode)


def _rebuild_distributed_error(problem, fix, rank, exitcode):
    return DistributedError(problem, fix=fix, rank=rank, exitcode=exitcode)
