"""A model carries its tokenizer into every stage that starts from it: a run whose config names
no tokenizer uses the starting model's (and records it, so the next stage finds it), a named
one that differs is used with a warning, and a tokenizer that does not fit the model, or a
teacher trained with another tokenizer, is refused in one line naming the setting."""

import dataclasses

import pytest
import torch
import yaml

from _tiny import tiny_train_model
from hybridlm.data.bpe import tokenizer_sha256, train_bpe
from hybridlm.data.sources import StdlibSource
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load_tokenizer_for, tokenizer_spec_for
from hybridlm.model.model import build_model
from hybridlm.train.stages.distill import run_distill
from hybridlm.train.stages.sft import SFTRunConfig, run_sft, sft_trainer
from test_distill import offline_run
from test_sft import tiny_sft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(StdlibSource(max_files=8), vocab_size=400)


def _model_dir(tmp_path, name, tokenizer, *, vocab_size=None):
    """A transformers directory of a fresh tiny model with `tokenizer` saved beside it."""
    cfg = tiny_train_model()
    cfg.vocab_size = vocab_size or tokenizer.vocab_size
    model = build_model(cfg, seed=0, device=torch.device("cpu"))
    return str(save_pretrained(model, tmp_path / name, tokenizer=tokenizer))


def _sft_from(tmp_path, out, start, **data):
    cfg = tiny_sft(tmp_path / out, steps=2)
    cfg.train.init_from = start
    cfg.train.checkpoint_interval = 0
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def test_a_stage_started_from_a_model_uses_its_tokenizer_and_hands_it_on(tmp_path, bpe):
    start = _model_dir(tmp_path, "bpe_model", bpe)
    cfg = _sft_from(tmp_path, "sft", start)
    assert cfg.data.tokenizer == ""  # the default names none
    run_sft(cfg)
    recorded = yaml.safe_load((tmp_path / "sft" / "run.yaml").read_text())
    assert recorded["data"]["tokenizer"] == start
    want = tokenizer_sha256(bpe)
    assert tokenizer_sha256(load_tokenizer_for(tmp_path / "sft")) == want  # the run directory
    assert tokenizer_sha256(load_tokenizer_for(tmp_path / "sft" / "hf")) == want  # its export
    # the next stage, started from the run directory, finds the same tokenizer
    again = sft_trainer(_sft_from(tmp_path, "sft2", str(tmp_path / "sft"))).module
    assert tokenizer_sha256(again.tokenizer) == want
    assert again.run.data.tokenizer == tokenizer_spec_for(tmp_path / "sft") == start
    # a fresh model's own tokenizer is the byte tokenizer
    fresh = sft_trainer(tiny_sft(tmp_path / "fresh", steps=1)).module
    assert isinstance(fresh.tokenizer, ByteTokenizer) and fresh.run.data.tokenizer == "byte"


def test_a_named_tokenizer_is_used_with_a_warning_or_refused_when_it_does_not_fit(
    tmp_path, bpe, capsys
):
    start = _model_dir(tmp_path, "bpe_model", bpe)
    trainer = sft_trainer(_sft_from(tmp_path, "byte", start, tokenizer="byte"))
    assert isinstance(trainer.module.tokenizer, ByteTokenizer)
    err = capsys.readouterr().err
    assert f"warning: data.tokenizer=byte is not the tokenizer {start} was trained with" in err
    small = _model_dir(tmp_path, "small", ByteTokenizer(), vocab_size=300)
    bpe.save(tmp_path / "tok400")
    tok_dir = str(tmp_path / "tok400")
    with pytest.raises(
        ValueError,
        match=r"^the tokenizer has 400 ids but the model of train.init_from has vocab_size 300",
    ):
        sft_trainer(_sft_from(tmp_path, "misfit", small, tokenizer=tok_dir))
    with pytest.raises(ValueError, match=r"^train.init_from='runs/nope': no such model; point"):
        sft_trainer(_sft_from(tmp_path, "missing", "runs/nope"))


def test_a_teacher_trained_with_another_tokenizer_is_refused(tmp_path, bpe):
    student = _model_dir(tmp_path, "student", bpe)
    teacher = _model_dir(tmp_path, "teacher", ByteTokenizer(), vocab_size=bpe.vocab_size)
    cfg = offline_run(tmp_path, teacher, steps=1)
    cfg.train.init_from = student
    with pytest.raises(ValueError, match=r"^distill.teacher=.*teacher was trained with another"):
        run_distill(cfg)


def test_shipped_post_training_configs_name_no_tokenizer_and_start_from_the_speedrun():
    for name in ("sft", "sft_tools"):
        cfg = SFTRunConfig.load(f"configs/{name}.yaml")
        assert cfg.data.tokenizer == "" and cfg.train.init_from.startswith("runs/speedrun/")
    for name in ("dpo", "distill", "qad", "rm"):
        raw = yaml.safe_load(open(f"configs/{name}.yaml"))
        assert "tokenizer" not in raw["data"], name
        assert raw["train"]["init_from"].startswith("runs/speedrun/"), name
