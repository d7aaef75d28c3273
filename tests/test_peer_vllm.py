"""benchmarks/peer_vllm.py's configurations of the peer: parsed by name, each recorded, a failure kept."""
import pytest


@pytest.fixture
def peer(bench_script):
    return bench_script("peer_vllm")


def test_configs_parse_by_name_and_bad_ones_say_how(peer):
    assert peer.parse_configs("default=;fa3=--attn-backend FLASH_ATTN; fp8kv=--kv-cache-dtype 'fp8';") == [
        ("default", []), ("fa3", ["--attn-backend", "FLASH_ATTN"]), ("fp8kv", ["--kv-cache-dtype", "fp8"])]
    for bad, why in (("--max-num-seqs 512", "NAME=ARGS"), ("a b=", "NAME=ARGS"), ("x=;x=--y", "named twice"),
                     (" ; ", "no configuration")):
        with pytest.raises(SystemExit, match=why):
            peer.parse_configs(bad)


def test_compared_with_the_fastest_configuration_that_ran(peer):
    ran = {"engine": "vLLM 0.26.0", "output_tok_per_s": 1000.0, "attention_backends": ["FLASH_ATTN"],
           "num_gpu_blocks": 10, "block_size": 16, "kv_cache_dtype": "auto"}
    rows = [peer.vllm_row("default", ran, []), peer.vllm_row("fi", {"error": "exit 1: see fi.log"}),
            peer.vllm_row("seqs512", {**ran, "output_tok_per_s": 1250.0}, ["--max-num-seqs", "512"]),
            peer.vllm_row("empty", {"engine": "vLLM 0.26.0", "output_tok_per_s": None})]
    assert rows[2]["args"] == ["--max-num-seqs", "512"] and "no output_tok_per_s" in rows[3]["error"]
    assert rows[0]["kv_cache_tokens"] == 160 and "FLASH_ATTN" in rows[0]["backend"]
    assert rows[1]["error"] == "exit 1: see fi.log" and "failed" in rows[1]["backend"]
    ours = [{"output_tok_per_s": 2500.0}]
    best = peer.compare(ours, rows)
    assert best["config"] == "seqs512"
    assert ours[0]["vs_vllm"] == 2.0 and ours[0]["vs_vllm_default"] == 2.5
    with pytest.raises(SystemExit, match="no vLLM configuration ran: fi: exit 1"):
        peer.compare(ours, [rows[1]])
