"""Network checks of milliseconds, made before the hub and download clients would retry for tens of seconds."""
from __future__ import annotations

import os
import re


def hub_host() -> str:
    """host[:port] of the Hugging Face endpoint (``HF_ENDPOINT``)."""
    from huggingface_hub import constants

    return re.sub(r"^\w+://", "", constants.ENDPOINT).split("/")[0]


def reachable(host: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host[:port]`` opens: a network check of milliseconds where the hub and
    download clients would retry for tens of seconds."""
    import socket

    # Behind a proxy a direct connection may fail while the hub client works: let the client try.
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    hostname, _, port = host.partition(":")
    try:
        socket.create_connection((hostname, int(port or 443)), timeout=timeout).close()
        return True
    except OSError:
        return False
