"""Checkpoints: atomic writes, keep-last-N, latest discovery, exact state restore, merging,
recorded sizes and checksums, resume past damaged checkpoints, run directories kept."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hybridlm.io import load_model, load_tokenizer_for
from hybridlm.io.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    file_sha256,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset
from hybridlm.train.checkpoint import (
    merge_checkpoints,
    merge_state_dicts,
    merge_weights,
    prepare_run_dir,
)
from hybridlm.train.objectives import causal_lm_loss


def _model():
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "ME"
    cfg.mtp.pattern = ""
    return HybridLM(cfg, seed=0)


def test_save_load_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 258, (1, 8))
    causal_lm_loss(model, model(x, mtp_depth=model.train_mtp_depth), x)[0].backward()
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
        loaded = load_model(where)
        assert not loaded.training
        with torch.no_grad():
            torch.testing.assert_close(loaded(x).logits, ref, atol=0, rtol=0)
        assert isinstance(load_tokenizer_for(where), ByteTokenizer)
    run_config["data"]["tokenizer"] = str(tmp_path / "gone")
    save_checkpoint(tmp_path, step=3, model=model, optimizer=None, meta={"run_config": run_config})
    with pytest.raises(ValueError, match="does not exist here"):
        load_tokenizer_for(tmp_path)
    with pytest.raises(ValueError, match="no such model; give a model path"):
        load_model(tmp_path / "checkpoints" / "nothing")


def _flip_byte(path, offset=-1):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_sizes_and_checksums_are_recorded_and_verified(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, meta={})
    files = read_meta(path)["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.pt"]
    for name, rec in files.items():
        assert rec == {"bytes": (path / name).stat().st_size, "sha256": file_sha256(path / name)}
    assert verify_checkpoint(path)["step"] == 1
    _flip_byte(path / "optimizer.pt")  # same size: only the checksum tells
    with pytest.raises(CheckpointError, match="optimizer.pt does not match its SHA-256"):
        verify_checkpoint(path)
    verify_checkpoint(path, checksums=False)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt is missing"):
        verify_checkpoint(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors has .* bytes"):
        verify_checkpoint(path)
    (path / "meta.json").write_text('{"step": 1')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify_checkpoint(path)


def test_checkpoints_without_recorded_checksums_still_load_and_verify(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, meta={})
    meta = read_meta(path)
    del meta["files"]  # as saved before sizes and checksums were recorded
    (path / "meta.json").write_text(json.dumps(meta))
    assert verify_checkpoint(path)["step"] == 1
    load_checkpoint(path, _model(), torch.optim.AdamW(_model().parameters()))
    opt_bytes = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(opt_bytes[: len(opt_bytes) // 2])
    with pytest.raises(CheckpointError, match="optimizer.pt is not a complete archive"):
        verify_checkpoint(path)
    (path / "optimizer.pt").write_bytes(opt_bytes)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # the header no longer covers the file
    with pytest.raises(CheckpointError, match="model.safetensors: .*incomplete metadata"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        load_checkpoint(path, _model())


def test_resume_skips_damaged_checkpoints_and_moves_them_aside(tmp_path):
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=None, meta={})
    root = checkpoint_dir(tmp_path)
    newest = root / "step_00000003" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    _flip_byte(root / "step_00000002" / "model.safetensors")  # same size, other bytes
    lines = []
    found = resume_checkpoint(tmp_path, log=lines.append)
    assert found == root / "step_00000001"
    assert len(lines) == 2
    assert "step_00000003" in lines[0] and "bytes" in lines[0] and "damaged-" in lines[0]
    assert "step_00000002" in lines[1] and "SHA-256" in lines[1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (root / "damaged-step_00000003").is_dir() and (root / "damaged-step_00000002").is_dir()
    # every checkpoint damaged: one error naming each, nothing moved (a retry says the same)
    _flip_byte(root / "step_00000001" / "model.safetensors")
    for _ in range(2):
        with pytest.raises(CheckpointError, match="no intact checkpoint .*step_00000001"):
            resume_checkpoint(tmp_path, log=lines.append)
    assert len(lines) == 2 and [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert resume_checkpoint(tmp_path / "empty") is None


def test_run_dir_keeps_an_earlier_run_unless_resumed_or_overwritten(tmp_path):
    out = tmp_path / "run"
    assert prepare_run_dir(out) == out and out.is_dir()
    (out / "metrics.jsonl").write_text("")  # empty: nothing to lose
    (out / "checkpoints" / ".tmp-step_00000001-1").mkdir(parents=True)  # a crashed save only
    prepare_run_dir(out)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(out, step=1, model=_model(), optimizer=None, meta={})
    with pytest.raises(ValueError, match="already holds a run .*--resume.*--overwrite"):
        prepare_run_dir(out)
    with pytest.raises(ValueError, match="exclude each other"):
        prepare_run_dir(out, resume=True, overwrite=True)
    prepare_run_dir(out, resume=True)
    assert (out / "metrics.jsonl").read_text() and list_checkpoints(out)
    prepare_run_dir(out, overwrite=True, remove=False)  # another rank: checks only
    assert list_checkpoints(out)
    # a stage without checkpoints owns only its metrics, and offers no --resume
    with pytest.raises(ValueError, match=r"\(metrics.jsonl\); replace it with --overwrite, or"):
        prepare_run_dir(out, outputs=("metrics.jsonl",))
    lines = []
    prepare_run_dir(out, overwrite=True, log=lines.append)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert lines == [f"overwrite: removed metrics.jsonl, checkpoints/ of the earlier run in {out}"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        prepare_run_dir(tmp_path / "file")
