"""benchmarks/ablate.py: every part it offers names a kernel or function that exists, leaves it doing nothing inside
``removed`` and puts it back after; part names are checked; deltas are against the base runs' mean."""
import importlib
import sys
import types

import pytest
import torch


@pytest.fixture
def ablate(bench_script):
    return bench_script("ablate")


def test_every_part_is_removed_and_put_back(ablate):
    from attnzoo.layers.moe.layer import FusedMoE

    for part, (module_name, attr, _) in ablate.PARTS.items():
        module = importlib.import_module(module_name)
        target, name = ((module, attr) if attr else (FusedMoE, "_routed") if part == "routed"
                        else (module, "latent_to_values"))
        original = getattr(target, name)  # the kernel or function a rename would lose: this fails first
        with ablate.removed(part):
            stand_in = getattr(target, name)
            assert stand_in is not original
            if attr:
                assert stand_in[(1,)](torch.zeros(1)) is None
        assert getattr(target, name) is original


def test_removed_routed_experts_return_the_shared_output(ablate):
    from attnzoo.layers.moe.layer import FusedMoE

    shared = torch.ones(2, 8)
    with ablate.removed("routed"):
        assert FusedMoE._routed(None, torch.zeros(2, 8), None, None, shared) is shared
        assert torch.equal(FusedMoE._routed(None, torch.ones(2, 8), None, None, None), torch.zeros(2, 8))
    with ablate.removed("wuv"):
        from attnzoo.attention import mla

        assert mla.latent_to_values(torch.zeros(3, 4, 16), torch.zeros(4, 5, 16)).shape == (3, 4, 5)


def test_part_names_are_checked(ablate):
    assert ablate.parse_parts("stage2, moe_sum") == ["stage2", "moe_sum"]
    with pytest.raises(SystemExit, match="bogus; choose from store, stage2"):
        ablate.parse_parts("stage2,bogus")
    with pytest.raises(SystemExit, match="none named"):
        ablate.parse_parts(" , ")


def test_deltas_are_against_the_base_runs_mean(ablate):
    def ran(part, tpot):
        return {"part": part, "result": {"tpot_mean_ms": tpot, "output_tok_per_s": 1e3 / tpot,
                                         "decode_roofline_fraction": 0.5}}

    rows = ablate.summarize([ran("base", 2.0), ran("stage2", 1.9), {"part": "skinny", "error": "exit 1: see x.log"},
                             ran("base", 2.2)])
    assert [r["part"] for r in rows] == ["base", "stage2", "skinny", "base"]
    assert rows[1]["delta_ms"] == pytest.approx(-0.2) and rows[0]["delta_ms"] == pytest.approx(-0.1)
    assert rows[2]["error"] == "exit 1: see x.log" and "delta_ms" not in rows[2]
    with pytest.raises(SystemExit, match="no base run finished"):
        ablate.summarize([{"part": "base", "error": "exit 1"}, ran("stage2", 1.0)])


def test_out_is_asked_for_and_kept_from_e2e(ablate):
    with pytest.raises(SystemExit, match="pass --out PREFIX before --"):
        ablate.main(["--parts", "stage2", "--", "--shape", "dsv2lite"])
    with pytest.raises(SystemExit, match="pass --out PREFIX before --"):
        ablate.main(["--out", "x", "--", "--out", "y"])


def test_a_child_runs_e2e_with_its_part_removed(ablate, monkeypatch):
    from attnzoo.attention.kernels import decode

    seen = []
    fake = types.ModuleType("e2e")
    fake.main = lambda argv: seen.append((argv, isinstance(decode._decode_stage2, ablate._NoLaunch)))
    monkeypatch.setitem(sys.modules, "e2e", fake)
    ablate.main(["--child", "stage2", "--", "--shape", "dsv2lite"])
    ablate.main(["--child", "base", "--", "--shape", "dsv2lite"])
    assert seen == [(["--shape", "dsv2lite"], True), (["--shape", "dsv2lite"], False)]
    assert not isinstance(decode._decode_stage2, ablate._NoLaunch)


def test_runs_base_each_part_base_and_records_them(ablate, monkeypatch, tmp_path, capsys):
    # Each child's command carries its part and e2e.py's arguments with the run's own --out; a child that fails is
    # recorded with its log and the others go on.
    import json

    calls = []
    real_run = ablate.subprocess.run

    def child(cmd, *args, **kwargs):
        if "--child" not in cmd:  # git, for the result's meta
            return real_run(cmd, *args, **kwargs)
        part, prefix = cmd[cmd.index("--child") + 1], cmd[cmd.index("--out", cmd.index("--")) + 1]
        calls.append((part, cmd[cmd.index("--") + 1:cmd.index("--out", cmd.index("--"))]))
        if part == "moe_sum":
            return types.SimpleNamespace(returncode=1)
        tpot = {"base": 2.0, "stage2": 1.9}[part]
        result = {"tpot_mean_ms": tpot, "output_tok_per_s": 1e3 / tpot, "decode_roofline_fraction": 0.6}
        (tmp_path / (prefix.rsplit("/", 1)[-1] + ".json")).write_text(json.dumps({"results": [result]}))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(ablate.subprocess, "run", child)
    ablate.main(["--out", str(tmp_path / "abl"), "--parts", "stage2,moe_sum", "--", "--shape", "dsv2lite"])
    assert calls == [(p, ["--shape", "dsv2lite"]) for p in ("base", "stage2", "moe_sum", "base")]
    rows = json.loads((tmp_path / "abl.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["base", "stage2", "moe_sum", "base"]
    assert rows[1]["delta_ms"] == pytest.approx(-0.1) and "exit 1" in rows[2]["error"]
    assert "stage2" in capsys.readouterr().out
