"""A pytest plugin that lets the GPU suite run whole across several short device calls on one machine.

    PYTHONPATH=tests python3 -m pytest -m gpu -p gpu_resume [--resume-file /tmp/suite_done.txt]

Every finished test's outcome is appended to the resume file as ``outcome<TAB>nodeid``; a later run
deselects the tests already there, so a call cut short by its time limit (``timeout -s INT`` lets
pytest stop cleanly) is continued by the next. A test whose setup failed is recorded as failed, one
whose teardown failed gets a second line ("error"), and a module that fails to import is recorded by
its path (pytest then stops every run: fix it, or pass ``--continue-on-collection-errors``). The file
keeps every outcome, so the last call's file is the suite's whole record. Delete the file to start
over, or a test's lines to run it again (a failure that an earlier test's CUDA error caused, say).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT = "/tmp/attnzoo_gpu_suite_done.txt"


def pytest_addoption(parser):
    parser.addoption("--resume-file", default=DEFAULT, help="where finished tests are recorded (gpu_resume)")


class _Resume:
    def __init__(self, path: Path):
        self.path = path

    def finished(self) -> set[str]:
        if not self.path.exists():
            return set()
        return {line.split("\t", 1)[1] for line in self.path.read_text().splitlines() if "\t" in line}

    def pytest_collection_modifyitems(self, config, items):
        done = self.finished()
        gone = [item for item in items if item.nodeid in done]
        if gone:
            config.hook.pytest_deselected(items=gone)
            items[:] = [item for item in items if item.nodeid not in done]

    def _record(self, outcome: str, nodeid: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{outcome}\t{nodeid}\n")

    def pytest_runtest_logreport(self, report):
        # the call phase's outcome; a setup that did not pass (error or skip), where no call follows; a
        # teardown that failed (a second line for the test: the last says how it ended)
        if report.when == "call" or (report.when != "call" and report.outcome != "passed"):
            self._record("error" if report.when == "teardown" else report.outcome, report.nodeid)

    def pytest_collectreport(self, report):
        # a module that does not import stops every run: recorded, so the file names it
        if report.failed:
            self._record("error", report.nodeid)


def pytest_configure(config):
    config.pluginmanager.register(_Resume(Path(config.getoption("resume_file"))), "gpu_resume_state")
