"""benchmarks/decode.py: cache memory measured == computed (fast); each section end to end on
reduced settings (slow), checking that the printed figures exist and are sane."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode  # noqa: E402
from hybridlm.data import builtin  # noqa: E402
from hybridlm.presets import get_preset  # noqa: E402


def test_measured_cache_bytes_equal_computed_and_kv_buffers_double():
    cfg = get_preset("tiny-super")
    cfg.mtp.pattern = ""
    # 300 tokens outgrow the initial KV capacity (256), so the buffers double once to 512
    for model_cfg in (cfg, decode.attention_only(cfg)):
        rows = decode.measure_memory(model_cfg, [64, 200, 300], chunk=128)
        assert [r["context"] for r in rows] == [64, 200, 300]
        for r in rows:
            assert r["measured_bytes"] == r["computed_bytes"] > 0, r
            assert r["allocated_bytes"] >= r["measured_bytes"]
        last = rows[-1]
        kv_tok = model_cfg.kv_cache_bytes_per_token(4)
        fixed = model_cfg.mamba_state_bytes_per_sequence(4)
        assert last["allocated_bytes"] == kv_tok * 512 + fixed
    assert decode.attention_only(cfg).pattern == "*" * len(cfg.pattern)
    # the hybrid holds less than the attention-only model at equal width and depth
    assert cfg.kv_cache_bytes_per_token() < decode.attention_only(cfg).kv_cache_bytes_per_token()


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit):
        decode.main(["--only", "nothing"])
    with pytest.raises(SystemExit):
        decode.main(["--only", "decode", "--new-tokens", "0"])


@pytest.mark.slow
def test_decode_section_reports_ratio_and_agreement(tmp_path, capsys):
    pytest.importorskip("transformers")
    args = ["--only", "decode", "--new-tokens", "8", "--prompt-len", "4", "--repeats", "1"]
    models = ["--models", "tiny-super,tiny-olmo", "--no-compile"]
    rc = decode.main([*args, *models, "--out", str(tmp_path)])
    text = capsys.readouterr().out
    lines = re.findall(r"ratio ([\d.]+)x \| greedy tokens agree (\d+)/(\d+)", text)
    assert len(lines) == 2, text  # tiny-super vs NemotronH, tiny-olmo vs Olmo3
    for ratio, agree, total in lines:
        assert float(ratio) > 0 and agree == total == "8", text
    # the bandwidth limit: weight bytes per token / copy bandwidth, and the share reached
    shares = re.findall(r"hybridlm at (\d+)% of it", text)
    assert len(shares) == 2 and all(0 < int(s) <= 100 for s in shares), text
    assert rc == 0
    assert (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_speculative_section_trains_reuses_and_matches_greedy(tmp_path, capsys):
    data = builtin.path(builtin.TINYSHAKESPEARE)
    common = [
        "--only",
        "speculative",
        "--out",
        str(tmp_path),
        "--data",
        str(data),
        "--prompts",
        "2",
        "--spec-prompt-len",
        "16",
        "--spec-new-tokens",
        "12",
        "--spec-repeats",
        "1",
        "--real-contexts",
        "8",
    ]
    train = ["--train-steps", "3", "--train-batch", "2", "--train-seq", "64", "--mtp-depth", "2"]
    rc = decode.main([*common, *train, "--ks", "1,3"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "[train] trained" in text
    m = re.search(
        r"acceptance length ([\d.]+) .* speedup ([\d.]+)x \| outputs identical (\d+)/(\d+)", text
    )
    assert m, text
    assert 1.0 <= float(m[1]) <= 4.0 and float(m[2]) > 0 and m[3] == m[4] == "2"
    assert len(re.findall(r"^\[speculative\] [13] \|", text, re.M)) == 2, text
    for png in ("train_loss.png", "acceptance.png"):
        assert (tmp_path / png).stat().st_size > 0
    assert (tmp_path / "spec-model" / "config.json").is_file()
    # a second run reuses the saved model
    rc = decode.main([*common, "--ks", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "[train] reused" in text, text


@pytest.mark.slow
def test_memory_section_measured_equals_computed(tmp_path, capsys):
    args = ["--only", "memory", "--contexts", "512,1024,2048", "--chunk", "512"]
    args += ["--measure-to", "2048", "--measure-attn-to", "1024", "--out", str(tmp_path)]
    rc = decode.main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "measured == computed at 3/3 contexts" in text, text
    assert "measured == computed at 2/2 contexts" in text, text
    assert len(re.findall(r"^\[memory\] nemotron-3", text, re.M)) == 2
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_active_weight_bytes_counts_one_embedding_row_and_the_chosen_experts():
    from hybridlm import HybridLM

    cfg = decode.memory_bound_config()
    cfg.d_model, cfg.vocab_size = 64, 100
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.state_size = 4, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 4, 2, 16
    cfg.moe.expert_hidden, cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 16, 64
    model = HybridLM(cfg, seed=0)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    expected = 4 * (rest - 100 * 64 + 64 + experts * cfg.moe.top_k // cfg.moe.num_experts)
    assert decode.active_weight_bytes(model) == expected
