"""Offline, the eval routes fail in seconds and before the model loads (the Hub client retried each file for
~23 s, every line printed twice), naming --data-dir; library log lines print once. No network is used: the
Hub is made unreachable by the same check the code makes."""
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from attnzoo import network  # noqa: E402
from attnzoo.errors import EvalError  # noqa: E402

RETRY_SECONDS = 23  # huggingface_hub's backoff over its 5 retries: 1 + 2 + 4 + 8 + 8
from helpers import fresh_python


@pytest.fixture
def no_hub(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(network, "reachable", lambda host, timeout=3.0: False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "attnzoo-empty-datasets-cache"))


def test_run_eval_documents_fail_fast_without_the_hub(no_hub):
    import datasets.config
    import huggingface_hub.constants

    from attnzoo.evals.tasks import load_tasks

    before = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    t = time.monotonic()
    with pytest.raises(EvalError, match="cannot be reached .*--data-dir"):
        load_tasks("gsm8k", None)
    assert time.monotonic() - t < RETRY_SECONDS / 2
    assert (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before  # restored


@pytest.mark.parametrize("tasks", [["--tasks", "gsm8k"], ["--tasks=gsm8k"], ["-t", "gsm8k"]])
def test_lm_eval_route_reads_documents_before_the_model(no_hub, monkeypatch, capsys, tasks):
    from attnzoo.evals import lm
    from attnzoo.evals.__main__ import main

    monkeypatch.setattr(lm.AttnzooLM, "__init__", lambda *a, **k: pytest.fail("the model loaded first"))
    t = time.monotonic()
    assert main(["run", "--model", "attnzoo", "--model_args", "pretrained=/nonexistent", *tasks, "--limit", "1"]) == 2
    assert time.monotonic() - t < RETRY_SECONDS / 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "--data-dir" in err


def test_lm_eval_route_with_hf_hub_offline_set_reads_documents_first(monkeypatch, capsys):
    from attnzoo.evals import lm
    from attnzoo.evals.__main__ import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(lm.AttnzooLM, "__init__", lambda *a, **k: pytest.fail("the model loaded first"))
    monkeypatch.setattr(network, "reachable", lambda host, timeout=3.0: pytest.fail("probed a network said offline"))
    t = time.monotonic()  # set after datasets' import, which read the environment: offline all the same
    assert main(["run", "--model", "attnzoo", "--tasks", "gsm8k", "--limit", "1"]) == 2
    assert time.monotonic() - t < RETRY_SECONDS / 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE" in err and "--data-dir" in err


def test_library_log_lines_print_once():
    """huggingface_hub and datasets log through a handler of their own and propagate: the CLIs' root handler
    must not print their lines again."""
    code = ("import logging\n"
            "from attnzoo.console import setup_logging\n"
            "setup_logging(logging.INFO)\n"
            "import huggingface_hub, datasets\n"
            "logging.getLogger('huggingface_hub.utils._http').warning('hub line')\n"
            "logging.getLogger('datasets.load').warning('datasets line')\n"
            "logging.getLogger('attnzoo').info('our line')\n")
    res = fresh_python(code)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    assert [lines.count(x) for x in ("hub line", "datasets line", "our line")] == [1, 1, 1], lines
