"""benchmarks/ablate.py: each part it offers is what the code path it names calls (on a CPU, under Triton's
interpreter: the part's stand-in counts the calls it took), and is put back after; part names are checked; a run
records e2e.py's attnzoo result, its failure or a part never called; deltas are against the base runs' mean."""
import json
import sys
import types

import pytest
import torch


@pytest.fixture
def ablate(bench_script):
    return bench_script("ablate")


def _norm(n):
    return types.SimpleNamespace(weight=torch.ones(n), eps=1e-6, offset=0.0)


def _store():
    from attnzoo.attention.kernels.store import store_kv

    store_kv(torch.arange(3), torch.randn(3, 2, 16), torch.zeros(4, 2, 16, 16))


def _stage2():
    from attnzoo.attention.kernels.decode import decode_attention

    kc = torch.randn(3, 1, 16, 32)
    decode_attention(torch.randn(1, 4, 32), kc, kc, torch.tensor([[1, 2]], dtype=torch.int32),
                     torch.tensor([20], dtype=torch.int32), scale=0.2, num_kv_splits=2)


def _fused(op):
    def run():
        from attnzoo.layers import fused

        with fused.use("triton"):
            op(fused)
    return run


def _skinny():
    from attnzoo.layers import skinny

    with skinny.use(True):
        skinny.linear(torch.randn(1, 32), torch.randn(16, 32))


def _moe(shared=None):
    def run():
        from attnzoo.layers.moe import FusedMoE
        from attnzoo.layers.moe.fused import fused_moe

        x, ids, weights = torch.randn(2, 32), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
        if shared is None:
            fused_moe(x, torch.randn(4, 32, 32) * 0.1, torch.randn(4, 32, 16) * 0.1, weights, ids)
        else:
            FusedMoE(4, 32, 16).forward(x, weights, ids, shared=shared)
    return run


EXERCISE = {
    "store": _store,
    "stage2": _stage2,
    "norm": _fused(lambda f: f.rms_norm(torch.randn(2, 32), _norm(32))),
    "mla_entry": _fused(lambda f: f.mla_entry(torch.randn(2, 4, 8), torch.randn(2, 24), _norm(16),
                                              torch.ones(2, 8), torch.zeros(2, 8))),
    "act_and_mul": _fused(lambda f: f.act_and_mul(torch.randn(2, 32), "silu")),
    "skinny": _skinny,
    "moe_act": _moe(),
    "moe_sum": _moe(),
    "routed": _moe(shared=lambda x: x * 2),
}


@pytest.mark.parametrize("part", list(EXERCISE) + ["wuv"])
def test_each_part_is_what_its_code_path_calls_and_is_put_back(ablate, part):
    target, name, _ = ablate.PARTS[part][1]()
    original = getattr(target, name)  # the kernel or function a rename would lose: this fails first
    with ablate.removed(part) as stand_in:
        assert getattr(target, name) is stand_in
        if part == "wuv":  # MLAAttention.forward looks W_UV's product up in its module when it runs
            from attnzoo.attention import mla

            assert "latent_to_values" in mla.MLAAttention.forward.__code__.co_names
            assert mla.latent_to_values(torch.zeros(3, 4, 16), torch.zeros(4, 5, 16)).shape == (3, 4, 5)
        else:
            EXERCISE[part]()
        assert stand_in.calls > 0, f"{part}: its code path never reached the stand-in"
    assert getattr(target, name) is original


def test_without_the_routed_experts_the_shared_output_is_the_layers(ablate):
    from attnzoo.layers.moe import FusedMoE

    x = torch.randn(2, 32)
    with ablate.removed("routed"):
        out = FusedMoE(4, 32, 16).forward(x, torch.rand(2, 2), torch.tensor([[0, 1], [2, 3]]), shared=lambda x: x * 2)
    assert torch.equal(out, x * 2)


def test_part_names_are_checked(ablate):
    assert ablate.parse_parts("stage2, moe_sum") == ["stage2", "moe_sum"]
    with pytest.raises(SystemExit, match="bogus; choose from store, stage2"):
        ablate.parse_parts("stage2,bogus")
    with pytest.raises(SystemExit, match="none named"):
        ablate.parse_parts(" , ")


def test_the_attnzoo_result_is_the_one_compared(ablate):
    ours = {"backend": "attnzoo prefill=triton decode=triton", "tpot_mean_ms": 2.0}
    assert ablate.attnzoo_result({"results": [{"backend": "transformers generate"}, ours]}) is ours
    with pytest.raises(SystemExit, match="one backend"):
        ablate.attnzoo_result({"results": [ours, dict(ours, backend="attnzoo prefill=torch decode=torch")]})


def _ran(part, tpot, calls=None):
    run = {"part": part, "log": f"{part}.log", "result": {"tpot_mean_ms": tpot, "output_tok_per_s": 1e3 / tpot,
                                                         "decode_roofline_fraction": 0.5}}
    return run if calls is None else {**run, "calls": calls}


def test_deltas_are_against_the_base_runs_mean(ablate):
    rows = ablate.summarize([_ran("base", 2.0), _ran("stage2", 1.9, 26), {"part": "skinny", "log": "s.log",
                             "error": "exit 1: see s.log"}, _ran("wuv", 1.8, 0), _ran("base", 2.2)])
    assert [r["part"] for r in rows] == ["base", "stage2", "skinny", "wuv", "base"]
    assert rows[1]["delta_ms"] == pytest.approx(-0.2) and rows[0]["delta_ms"] == pytest.approx(-0.1)
    assert rows[2]["error"] == "exit 1: see s.log" and "delta_ms" not in rows[2]
    assert "never called" in rows[3]["error"] and "delta_ms" not in rows[3]
    with pytest.raises(SystemExit, match="no base run finished.*b.log"):
        ablate.summarize([{"part": "base", "log": "b.log", "error": "exit 1"}, _ran("stage2", 1.0, 1)])


def test_its_own_arguments_and_e2e_s_are_asked_for(ablate):
    for argv in (["--parts", "stage2", "--", "--shape", "dsv2lite"], ["--out", "x"], ["--out", "x", "--"],
                 ["--out", "x", "--", "--out", "y"]):
        with pytest.raises(SystemExit, match="pass --out PREFIX, then -- and e2e.py's arguments"):
            ablate.main(argv)


def test_a_child_runs_e2e_with_its_part_removed(ablate, monkeypatch, tmp_path):
    from attnzoo.attention.kernels import decode

    seen = []
    fake = types.ModuleType("e2e")
    fake.main = lambda argv: seen.append((argv, isinstance(decode._decode_stage2, ablate._NoLaunch)))
    monkeypatch.setitem(sys.modules, "e2e", fake)
    prefix = str(tmp_path / "1_stage2")
    ablate.main(["--child", "stage2", "--child-out", prefix, "--", "--shape", "dsv2lite"])
    ablate.main(["--child", "base", "--child-out", prefix + "b", "--", "--shape", "dsv2lite"])
    tail = ["--hf-prompts", "0", "--out"]
    assert seen == [(["--shape", "dsv2lite", *tail, prefix], True), (["--shape", "dsv2lite", *tail, prefix + "b"], False)]
    assert (tmp_path / "1_stage2.calls").read_text() == "0"  # the fake e2e launched nothing
    assert not isinstance(decode._decode_stage2, ablate._NoLaunch)


def test_runs_base_each_part_base_each_in_its_own_files(ablate, monkeypatch, tmp_path, capsys):
    # Each child gets its part, e2e.py's arguments and a prefix of its own (no dot, which e2e.py's with_suffix would
    # cut, even where --out has one); a child that fails keeps its log and the others go on.
    calls = []
    real_run = ablate.subprocess.run

    def child(cmd, *args, **kwargs):
        if "--child" not in cmd:  # git, for the result's meta
            return real_run(cmd, *args, **kwargs)
        part, prefix = cmd[cmd.index("--child") + 1], cmd[cmd.index("--child-out") + 1]
        calls.append((part, prefix, cmd[cmd.index("--") + 1:]))
        if part == "moe_sum":
            return types.SimpleNamespace(returncode=1)
        tpot = {"base": 2.0, "stage2": 1.9}[part]
        result = {"backend": "attnzoo prefill=triton decode=triton", "tpot_mean_ms": tpot,
                  "output_tok_per_s": 1e3 / tpot, "decode_roofline_fraction": 0.6}
        with open(prefix + ".json", "w") as f:
            json.dump({"results": [{"backend": "transformers generate"}, result]}, f)
        if part != "base":
            with open(prefix + ".calls", "w") as f:
                f.write("27")
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(ablate.subprocess, "run", child)
    ablate.main(["--out", str(tmp_path / "abl.v2"), "--parts", "stage2,moe_sum", "--", "--shape", "dsv2lite"])
    assert [(p, a) for p, _, a in calls] == [(p, ["--shape", "dsv2lite"]) for p in ("base", "stage2", "moe_sum", "base")]
    prefixes = [pre for _, pre, _ in calls]
    assert len(set(prefixes)) == 4 and all("." not in pre.rsplit("/", 1)[-1] for pre in prefixes)
    assert all(pre.startswith(str(tmp_path / "abl.v2_runs")) for pre in prefixes)
    rows = json.loads((tmp_path / "abl.v2.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["base", "stage2", "moe_sum", "base"]
    assert rows[1]["delta_ms"] == pytest.approx(-0.1)
    assert "exit 1" in rows[2]["error"] and rows[2]["log"].endswith("2_moe_sum.log")
    assert "stage2" in capsys.readouterr().out
