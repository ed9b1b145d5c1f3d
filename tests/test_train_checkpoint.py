"""Checkpoints: atomic writes, keep-last-N, latest discovery, exact state restore, merging."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset
from hybridlm.train.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    merge_checkpoints,
    merge_state_dicts,
    merge_weights,
    read_meta,
    save_checkpoint,
)


def _model():
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "ME"
    cfg.mtp.pattern = ""
    return HybridLM(cfg, seed=0)


def test_save_load_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 258, (1, 8)), torch.randint(0, 258, (1, 8))).loss.backward()
    opt.step()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, step=7, model=model, optimizer=opt, meta={"tokens_seen": 5})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    meta = read_meta(path)
    assert meta["step"] == 7 and meta["tokens_seen"] == 5 and meta["format_version"] == 1
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    load_checkpoint(path, other, opt2)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


def test_half_written_checkpoint_is_ignored_and_keep_last_n(tmp_path):
    model = _model()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=None, meta={}, keep_last_n=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    root = checkpoint_dir(tmp_path)
    # a crash mid-save leaves a temp dir (even one with files) and maybe a dir without meta.json
    torn = root / ".tmp-step_00000005-999"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    (torn / "meta.json").write_text('{"step": 5')
    (root / "step_00000006").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    save_checkpoint(tmp_path, step=5, model=model, optimizer=None, meta={}, keep_last_n=2)
    assert not torn.exists()  # the next save cleans up leftovers
    assert latest_checkpoint(tmp_path).name == "step_00000005"
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="no meta.json"):
        read_meta(root / "step_00000006")


def test_merge_weights():
    assert merge_weights(4, "uniform") == [0.25] * 4
    w = merge_weights(4, "minus_sqrt")
    assert w == pytest.approx([0.5, 0.2071067812, 0.1589186226, 0.1339745962])
    assert sum(w) == pytest.approx(1.0)
    # emulation: sum_{j>=i} c_j = 1 - sqrt((i - 1) / n)
    assert sum(w[2:]) == pytest.approx(1 - (2 / 4) ** 0.5)
    assert merge_weights(1, "minus_sqrt") == [1.0]
    with pytest.raises(ValueError, match="uniform or minus_sqrt"):
        merge_weights(2, "ema")


def test_merge_two_known_state_dicts(tmp_path):
    a = {
        "w": torch.tensor([0.0, 2.0]),
        "h": torch.tensor([1.0], dtype=torch.bfloat16),
        "n": torch.tensor([3]),
    }
    b = {
        "w": torch.tensor([4.0, 6.0]),
        "h": torch.tensor([3.0], dtype=torch.bfloat16),
        "n": torch.tensor([9]),
    }
    out = merge_state_dicts([a, b], [0.5, 0.5])
    assert torch.equal(out["w"], torch.tensor([2.0, 4.0]))
    assert out["h"].dtype == torch.bfloat16 and out["h"].item() == 2.0
    assert out["n"].item() == 9  # integer tensors: the newest
    for name, sd in (("step_00000001", a), ("step_00000002", b)):
        (tmp_path / name).mkdir()
        save_file(sd, str(tmp_path / name / "model.safetensors"))
    paths = [tmp_path / "step_00000001", tmp_path / "step_00000002"]
    merged = merge_checkpoints(paths, [0.25, 0.75])
    assert torch.allclose(merged["w"], torch.tensor([3.0, 5.0]))
    ms = merge_checkpoints(paths, "minus_sqrt")
    c1 = 1 / 2**0.5
    assert torch.allclose(ms["w"], torch.tensor([4 * (1 - c1), c1 * 2 + 6 * (1 - c1)]))
    with pytest.raises(ValueError, match="different keys"):
        merge_state_dicts([a, {"w": a["w"]}], [0.5, 0.5])


def test_meta_is_json(tmp_path):
    path = save_checkpoint(tmp_path, step=0, model=_model(), optimizer=None, meta={"x": [1]})
    assert json.loads((path / "meta.json").read_text())["x"] == [1]


def test_checkpoint_and_run_dirs_load_as_models_with_their_tokenizer(tmp_path):
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.train.checkpoint import tokenizer_for

    model = _model()
    run_config = {"model": model.config.to_dict(), "data": {"tokenizer": "byte"}}
    for step in (1, 2):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        path = save_checkpoint(
            tmp_path, step=step, model=model, optimizer=None, meta={"run_config": run_config}
        )
    x = torch.randint(0, 258, (1, 6))
    with torch.no_grad():
        ref = model.eval()(x).logits
    for where in (path, tmp_path):  # the checkpoint itself, and the run (its newest one)
        loaded = HybridLM.from_pretrained(where)
        assert not loaded.training
        with torch.no_grad():
            torch.testing.assert_close(loaded(x).logits, ref, atol=0, rtol=0)
        assert isinstance(tokenizer_for(where), ByteTokenizer)
    run_config["data"]["tokenizer"] = str(tmp_path / "gone")
    save_checkpoint(tmp_path, step=3, model=model, optimizer=None, meta={"run_config": run_config})
    with pytest.raises(ValueError, match="does not exist here"):
        tokenizer_for(tmp_path)
    with pytest.raises(ValueError, match="neither a transformers directory"):
        HybridLM.from_pretrained(tmp_path / "checkpoints" / "nothing")
