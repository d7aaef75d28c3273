"""Programmatic dependent launch (attnzoo.pdl): every kernel that takes it waits before touching memory, it is
off where it cannot run, and on a GPU a decode with it gives the bits of a decode without it."""
import ast
import inspect
import textwrap

import pytest
import torch

from attnzoo import pdl

GPU = torch.cuda.is_available()


def _pdl_kernels():
    from attnzoo.attention.kernels import decode, store
    from attnzoo.layers import fused_kernels, moe_kernels, skinny_kernels

    kernels = [decode._decode_stage1, decode._cascade_shared, decode._decode_stage2, store._store_kernel,
               skinny_kernels._skinny_kernel, fused_kernels._rms_norm_kernel, fused_kernels._act_and_mul_kernel,
               fused_kernels._rope_kernel, fused_kernels._argmax_chunks_kernel, fused_kernels._argmax_rows_kernel,
               moe_kernels.align_kernel, moe_kernels.gemm_kernel, moe_kernels.act_kernel, moe_kernels.sum_kernel,
               moe_kernels.route_kernel, fused_kernels._mla_entry_kernel]
    return {k.fn.__name__: k for k in kernels}


# Before the wait only index arithmetic and l2_prefetch (which reaches only L2, where memory is coherent) may run.
_BEFORE_THE_WAIT = {"program_id", "arange", "to", "minimum", "l2_prefetch"}


def _calls_before_the_wait(source: str) -> list[str] | None:
    """The callees a kernel's body calls before ``prior_done(PDL)`` outside ``_BEFORE_THE_WAIT``; None without it."""
    body = ast.parse(textwrap.dedent(source)).body[0].body
    stmts = [ast.unparse(s) for s in body]
    if "prior_done(PDL)" not in stmts:
        return None
    calls = [node for stmt in body[:stmts.index("prior_done(PDL)")] for node in ast.walk(stmt)
             if isinstance(node, ast.Call)]
    callees = [ast.unparse(node.func).rsplit(".", 1)[-1] for node in calls]
    return [callee for callee in callees if callee not in _BEFORE_THE_WAIT]


@pytest.mark.parametrize("name", sorted(_pdl_kernels()))
def test_a_pdl_kernel_waits_for_its_predecessor_before_any_memory_access(name):
    # A read before the wait could see the previous kernel's output half-written; a write could race its reads.
    kernel = _pdl_kernels()[name]
    assert "PDL" in kernel.arg_names
    assert _calls_before_the_wait(inspect.getsource(kernel.fn)) == [], name


def test_the_wait_check_catches_a_load_or_a_missing_wait():
    ok = "def k(X, W, PDL):\n    pid = tl.program_id(0)\n    l2_prefetch(W + pid, 64)\n    prior_done(PDL)\n"
    assert _calls_before_the_wait(ok) == []
    assert _calls_before_the_wait(ok.replace("l2_prefetch(W + pid, 64)", "x = tl.load(X + pid)")) == ["load"]
    assert _calls_before_the_wait(ok.replace("prior_done(PDL)", "pass")) is None


def test_pdl_is_off_on_a_cpu_and_within_use_false():
    x = torch.zeros(4)
    assert pdl.launch_args(x) == {"PDL": False, "launch_pdl": False}
    with pdl.use(False):
        assert not pdl.enabled(x)
        with pdl.use(True):
            assert not pdl.enabled(x)  # still a CPU tensor
    if GPU:
        y = x.cuda()
        on = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl.enabled(y) is on
        with pdl.use(False):
            assert pdl.launch_args(y) == {"PDL": False, "launch_pdl": False}
        assert pdl.enabled(y) is on


def test_a_grid_past_one_program_per_sm_launches_without_pdl(monkeypatch):
    # Launched early, a multi-wave grid's first programs wait on SMs the kernel before still streams on.
    monkeypatch.setattr(pdl, "enabled", lambda x: True)
    monkeypatch.setattr(pdl, "sm_count", lambda index: 132)
    x = torch.zeros(1)
    assert pdl.launch_args(x)["launch_pdl"] and pdl.launch_args(x, 132)["launch_pdl"]
    assert pdl.launch_args(x, 133) == {"PDL": False, "launch_pdl": False}


def test_the_skinny_launch_gives_pdl_its_grid(monkeypatch):
    # Llama's gate_up (224 programs) and LM head lose PDL on a 132-SM GPU; its 96-program qkv keeps it.
    from attnzoo.layers import skinny, skinny_kernels

    grids = []
    monkeypatch.setattr(skinny_kernels.pdl, "launch_args",
                        lambda x, programs=None: grids.append(programs) or {"PDL": False, "launch_pdl": False})
    dev = "cuda" if GPU else "cpu"  # a CPU runs it under the interpreter (conftest)
    x, w = torch.randn(1, 64, device=dev), torch.randn(300, 64, device=dev)
    with skinny.use(True):
        skinny_kernels.linear(x, w, config=skinny_kernels.Config(32, 64, 4, 1))
    assert grids == [10]


@pytest.mark.skipif(not GPU, reason="the interpreter on GPU tensors needs a GPU")
def test_pdl_is_off_under_the_interpreter_on_gpu_tensors_too(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # it runs kernels on GPU tensors but has no grid dependency control
    assert pdl.launch_args(torch.zeros(1, device="cuda")) == {"PDL": False, "launch_pdl": False}


def test_an_optional_kernel_module_is_none_without_its_package_and_an_error_with_a_wrong_version(tmp_path, monkeypatch):
    from attnzoo.errors import BackendError
    from attnzoo.lazy import optional_module

    (tmp_path / "pdl_missing_pkg.py").write_text("import no_such_package_for_attnzoo_tests\n")
    (tmp_path / "pdl_old_version.py").write_text("from json import no_such_name\n")  # an installed package lacking it
    (tmp_path / "pdl_own_bug.py").write_text("import attnzoo.no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert optional_module("pdl_missing_pkg") is None
    with pytest.raises(BackendError, match="pdl_old_version.*Fix: install the versions"):
        optional_module("pdl_old_version")
    with pytest.raises(ModuleNotFoundError):
        optional_module("pdl_own_bug")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs an SM90+ GPU")
@pytest.mark.parametrize("model", ["llama", "deepseek_v2"])
def test_graph_decode_with_pdl_gives_the_bits_of_decode_without_it(tmp_path, model):
    """bfloat16 at batches 1 and 3, so the skinny projections, fused norms and RoPE, the KV store, both decode
    stages and (DeepSeek) the MoE's route, sort, GEMMs and sum all launch with PDL inside the CUDA graphs."""
    import attnzoo
    from helpers import random_prompts, save_checkpoint
    from test_deepseek import MODELS
    from test_llama import tiny_llama

    save_checkpoint(tiny_llama(heads=8, kv_heads=2, head_dim=64, layers=3) if model == "llama"
                    else MODELS["v2-noqlora-grouped"][0](), tmp_path)
    outs = {}
    for on in (False, True):
        with pdl.use(on):
            llm = attnzoo.load_model(tmp_path, backend="triton", dtype="bfloat16", page_size=16, cuda_graph=True,
                                     max_running=4)
            for n in (1, 3):
                prompts = random_prompts(160, [7 + 11 * i for i in range(n)], seed=n)
                outs[on, n] = llm.generate(prompts, max_new_tokens=32, ignore_eos=True, return_logits=True)
            assert llm.engine.graph_stats["replayed"] > 0
        del llm
    for n in (1, 3):
        for a, b in zip(outs[False, n], outs[True, n]):
            assert a.token_ids == b.token_ids
            assert torch.equal(a.logits, b.logits)
