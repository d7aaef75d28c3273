"""What every benchmark script shares: the CUDA timer, the run's metadata (device, versions, git SHA, a hash of
the source that ran) and the result writer. Scripts import it as ``from common import ...``: a script's own
folder is on ``sys.path`` when it runs, so no path set-up is needed."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def time_cuda(fn, *, warmup: int = 5, iters: int = 20, flush: torch.Tensor | None = None,
              samples: bool = False) -> float | list[float]:
    """Median milliseconds of ``fn`` by CUDA events (all of them, sorted, with ``samples``). ``flush`` is zeroed
    before each run, untimed, to empty the L2 cache; every run is queued before one synchronize, so the host's
    launch time is not counted."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times if samples else times[len(times) // 2]


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after one eager run): its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def versions() -> dict:
    """Python, torch, CUDA and the kernel libraries' versions (``None`` where one is not installed)."""
    from attnzoo.evals.report import versions as installed

    v = installed()
    for mod in ("triton", "flashinfer", "transformers"):
        v.setdefault(mod, None)
    return v


def git_sha() -> str | None:
    """The checkout's commit, with ``+dirty`` when files differ from it; ``None`` outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


SOURCE_SUFFIXES = (".py", ".toml", ".json")


def source_hash(rev: str | None = None) -> str | None:
    """The first 12 hex digits of a sha256 over attnzoo/'s source files (paths and bytes, sorted): the code a run
    ran, also where the checkout's .git is stale, as on a device copy of the working tree. ``rev``: the same hash
    of a commit's files, to find which commit a recorded result ran (``python benchmarks/common.py REV``)."""
    h = hashlib.sha256()
    if rev is None:
        files = sorted(p for p in (ROOT / "attnzoo").rglob("*")
                       if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.is_file())
        items = ((p.relative_to(ROOT).as_posix(), p.read_bytes()) for p in files)
    else:
        try:
            names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "attnzoo/"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.split()
            items = ((n, subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True,
                                        check=True).stdout)
                     for n in sorted(names) if n.endswith(SOURCE_SUFFIXES))
            items = list(items)
        except (OSError, subprocess.CalledProcessError):
            return None
    for name, data in items:
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:12]


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_slug() -> str:
    """The GPU's name as result files name it: ``NVIDIA H200`` -> ``nvidia_h200``."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name().lower()).strip("_")


def run_meta(**extra) -> dict:
    """Where and with what a run ran: device, compute capability, versions, git SHA, UTC time, plus ``extra``."""
    meta = {"device": gpu_name(), "versions": versions(), "git_sha": git_sha(), "source_hash": source_hash(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        meta["capability"] = "sm%d%d" % torch.cuda.get_device_capability()
    return {**meta, **extra}


def write_result(path: str | Path, payload: dict, **meta) -> Path:
    """Write ``{"meta": run_meta(**meta), **payload}`` as JSON to ``path`` (``.json`` added when missing). One file
    per (benchmark, shape, GPU, variant): a newer run replaces it and git keeps the old one."""
    path = Path(path)
    if path.suffix != ".json":
        path = path.with_name(path.name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": run_meta(**meta), **payload}, indent=2, default=str))
    return path


if __name__ == "__main__":  # which commit a result's source_hash names: python benchmarks/common.py [REV ...]
    import sys

    for rev in sys.argv[1:] or [None]:
        print(rev or "working tree", source_hash(rev))
