"""benchmarks/results/ holds one file per (benchmark, shape, GPU, variant): a newer run replaces the file and git
keeps the older ones, so no file is named by the session that made it."""
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
BY_SESSION = re.compile(r"(^|_)(s\d+|session\d*)(_|\.|$)")


def test_the_pattern_catches_session_names():
    for name in ("e2e_llama8b_s9_nvidia_h200.json", "peer_vllm_gemma4_31b_session5_nvidia_h200.png",
                 "session7_gpu_nvidia_h200.txt", "moe_s7_nvidia_h200.txt"):
        assert BY_SESSION.search(name), name
    for name in ("e2e_dsv32_6layers_nvidia_h200.json", "tp_e2e_dsv3_8l_fp8_2xh200.log", "moe_sweep_nvidia_h200.json"):
        assert not BY_SESSION.search(name), name


def test_no_result_file_is_named_by_session():
    named = sorted(p.name for p in RESULTS.iterdir() if BY_SESSION.search(p.name))
    assert not named, f"rename to the (benchmark, shape, GPU, variant) name and delete older versions: {named}"


def test_every_result_file_is_indexed():
    index = (RESULTS / "README.md").read_text()
    stems = {p.name.split(".")[0] for p in RESULTS.iterdir() if p.name != "README.md"}
    # an index row may name a family with braces or *: match on the part before the first brace or star
    prefixes = {m.split("{")[0].split("*")[0].split(".")[0] for m in re.findall(r"`([^`]+)`", index)}
    missing = sorted(s for s in stems if not any(p and s.startswith(p) for p in prefixes))
    assert not missing, f"add these to benchmarks/results/README.md: {missing}"


def test_source_hash_names_the_code_and_matches_its_commit(tmp_path):
    """A result's source_hash is the working tree's attnzoo/ sources; the same hash of a commit finds the commit
    a recorded result ran (a device copy's .git can be stale). Checked in a repository of the test's own."""
    import importlib.util
    import shutil
    import subprocess

    spec = importlib.util.spec_from_file_location("bench_common", RESULTS.parent / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    (tmp_path / "attnzoo" / "sub").mkdir(parents=True)
    (tmp_path / "attnzoo" / "a.py").write_text("x = 1\n")
    (tmp_path / "attnzoo" / "sub" / "t.toml").write_text("k = 2\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "one"], cwd=tmp_path, check=True)
    common.ROOT = tmp_path
    first = common.source_hash()
    assert first and first == common.source_hash("HEAD")
    (tmp_path / "attnzoo" / "__pycache__").mkdir()
    (tmp_path / "attnzoo" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "attnzoo" / "notes.txt").write_text("not source")
    assert common.source_hash() == first  # caches and other files are not the code
    (tmp_path / "attnzoo" / "a.py").write_text("x = 2\n")
    assert common.source_hash() != first and common.source_hash("HEAD") == first
    shutil.rmtree(tmp_path / ".git")
    assert common.source_hash("HEAD") is None
