"""tests/gpu_resume.py: a suite cut short is continued by the next run, and the file records every outcome."""
import subprocess
import sys
from pathlib import Path

TESTS = '''
import os, pytest

def test_a():
    pass

def test_b():
    assert os.environ.get("B_OK") == "1"

@pytest.mark.skip(reason="never")
def test_c():
    pass

def test_d():
    if os.environ.get("STOP"):
        raise KeyboardInterrupt  # what `timeout -s INT` does to a run: pytest stops cleanly


@pytest.fixture
def breaks_on_teardown():
    yield
    raise RuntimeError("teardown")


def test_e(breaks_on_teardown):
    pass
'''


def _run(tmp_path: Path, resume: Path, **env) -> str:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_resume", "-p", "no:cacheprovider",
                        "--resume-file", str(resume), "test_synthetic.py"],
                       cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(Path(__file__).parent), "PATH": "/usr/bin:/bin", **env})
    return r.stdout


def _record(resume: Path) -> dict[str, str]:
    """test name -> its last line's outcome"""
    return {line.split("\t")[1].split("::")[-1]: line.split("\t")[0] for line in resume.read_text().splitlines()}


def test_a_cut_short_suite_is_continued_and_recorded(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(TESTS)
    resume = tmp_path / "done.txt"
    out = _run(tmp_path, resume, STOP="1")
    assert "Interrupted" in out or "KeyboardInterrupt" in out, out
    assert _record(resume) == {"test_a": "passed", "test_b": "failed", "test_c": "skipped"}
    assert "test_e" not in resume.read_text()  # the interrupted run never reached it
    # the next run does only what is left, and a test dropped from the file runs again
    resume.write_text("".join(line + "\n" for line in resume.read_text().splitlines() if "test_b" not in line))
    out = _run(tmp_path, resume)
    assert "1 failed, 2 passed, 2 deselected, 1 error" in out, out  # test_b again; test_e breaks on teardown
    assert _record(resume) == {"test_a": "passed", "test_c": "skipped", "test_b": "failed", "test_d": "passed",
                               "test_e": "error"}
    out = _run(tmp_path, resume)
    assert "5 deselected" in out, out


def test_a_module_that_does_not_import_is_named(tmp_path):
    (tmp_path / "test_broken.py").write_text("import not_a_module_anywhere\n")
    resume = tmp_path / "done.txt"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_resume", "-p", "no:cacheprovider",
                        "--resume-file", str(resume), "test_broken.py"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(Path(__file__).parent), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and resume.read_text() == "error\ttest_broken.py\n"
