"""`hybridlm.io`: every kind of model path loads to the same model, with its tokenizer, the
metadata the path holds and the directory it stands for."""

import pytest
import torch

from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load, load_model, resolve
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset


def _model() -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "ME"
    cfg.mtp.pattern = ""
    return HybridLM(cfg, seed=0).eval()


def test_checkpoints_run_dirs_and_transformers_dirs_load_the_same_model(tmp_path):
    model = _model()
    meta = {"run_config": {"model": model.config.to_dict(), "data": {"tokenizer": "byte"}}}
    for step in (1, 2):
        ckpt = save_checkpoint(tmp_path / "run", step=step, model=model, optimizer=None, meta=meta)
    save_pretrained(model, tmp_path / "hf", tokenizer=ByteTokenizer())
    x = torch.randint(0, 258, (1, 6))
    with torch.no_grad():
        ref = model(x).logits
    for where, kind, path in [
        (tmp_path / "run", "checkpoint", ckpt),  # a run directory: its newest checkpoint
        (ckpt, "checkpoint", ckpt),
        (tmp_path / "hf", "transformers", tmp_path / "hf"),
    ]:
        assert resolve(where) == (path, kind)
        loaded = load(where)
        assert (loaded.kind, loaded.path) == (kind, path)
        assert isinstance(loaded.tokenizer, ByteTokenizer)
        with torch.no_grad():
            torch.testing.assert_close(loaded.model.eval()(x).logits, ref, atol=0, rtol=0)
    assert load(ckpt).meta["step"] == 2
    assert load(tmp_path / "hf").meta["model_type"] == "nemotron_h"
    assert load_model(ckpt, dtype=torch.float64).embeddings.weight.dtype == torch.float64


def test_the_tokenizer_can_be_given_and_bad_paths_say_what_is_expected(tmp_path):
    model = _model()
    meta = {"run_config": {"model": model.config.to_dict(), "data": {"tokenizer": "/gone"}}}
    save_checkpoint(tmp_path / "run", step=1, model=model, optimizer=None, meta=meta)
    with pytest.raises(ValueError, match="does not exist here"):
        load(tmp_path / "run")
    assert isinstance(load(tmp_path / "run", tokenizer="byte").tokenizer, ByteTokenizer)
    with pytest.raises(ValueError, match=r"'.*nothing': no such model; give a model path"):
        load(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"^train.init_from='.*nothing': no such model; point "):
        load_model(tmp_path / "nothing", setting="train.init_from")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither a transformers directory \(config.json\)"):
        load(tmp_path / "empty")
    (tmp_path / "bare" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="nor a run with checkpoints"):
        load_model(tmp_path / "bare")
    save_checkpoint(tmp_path / "norun", step=1, model=model, optimizer=None, meta={})
    with pytest.raises(ValueError, match="no run_config.model"):
        load_model(tmp_path / "norun")
