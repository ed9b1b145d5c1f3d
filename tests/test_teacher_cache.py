"""Cached teacher top-k: an offline distillation that reads the cache takes the same steps as one
that runs the teacher (k = vocabulary: losses equal within 1e-6), the cache resumes shard by
shard and refuses other conversations, and 16-bit log-probs stay close."""

import argparse
import json
import shutil

import numpy as np
import pytest
import torch

from _tiny import tiny_run, tiny_train_model
from hybridlm.cli.train import register
from hybridlm.data.sft import SFTLoader
from hybridlm.io import load_model
from hybridlm.report.plot import read_metrics
from hybridlm.train.post_training import prepare_chat_data
from hybridlm.train.stages.distill import run_distill
from hybridlm.train.teacher_cache import CacheSpec, TeacherTopK, build_teacher_cache
from hybridlm.train.trainer import run_tokenizer
from test_distill import offline_run, save_teacher

pytestmark = pytest.mark.usefixtures("one_thread")


def _examples(tmp_path):
    run = offline_run(tmp_path, "unused")
    data = prepare_chat_data(run.data, run_tokenizer(run.data, run.train))
    return run, data.examples


def test_cached_distillation_equals_online_for_k_equal_vocab(tmp_path, capsys):
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    vocab = tiny_train_model().vocab_size
    online = offline_run(tmp_path / "online", teacher, steps=4, top_k=vocab)
    online.train.eval_interval = 2
    run_distill(online)

    cached = offline_run(tmp_path / "cached", teacher, steps=4, top_k=vocab)
    cached.train.eval_interval = 2
    cached.distill.teacher_cache = str(tmp_path / "cache")
    path = tmp_path / "distill.yaml"
    cached.save(path)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["distill-cache", "--config", str(path)])
    args.fn(args)
    printed = capsys.readouterr().out
    built = json.loads(printed[printed.index("{\n") :])
    assert built["shards_written"] == 2 and built["tokens"] > 0  # train and held
    run_distill(cached)

    def rows(run):
        return read_metrics(f"{run.train.out_dir}/metrics.jsonl")

    a = [r for r in rows(online) if r["kind"] in ("train", "eval")]
    b = [r for r in rows(cached) if r["kind"] in ("train", "eval")]
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "kl", "ce", "eval_kl"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-6, (key, ra["step"], ra[key], rb[key])
    # the cached run never loads the teacher: no teacher reference row
    assert not [r for r in rows(cached) if r["kind"] == "teacher"]
    assert [r for r in rows(online) if r["kind"] == "teacher"]


def test_cache_entries_are_the_teachers_top_k_and_resume_by_shard(tmp_path):
    teacher_path = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=2, sharpen=10.0)
    teacher = load_model(teacher_path).eval()
    run, examples = _examples(tmp_path)
    examples = examples[:40]
    spec = CacheSpec(teacher=teacher_path, k=8, vocab_size=258, examples_per_shard=16)
    root = tmp_path / "cache"
    first = build_teacher_cache(
        root, teacher, {"train": examples}, spec, seq_len=128, progress=False
    )
    assert first["shards_written"] == 3 and first["bytes_per_token"] == 8 * 8
    cache = TeacherTopK(root, "train", examples)
    # a packed batch in another arrangement than the cache was built in
    batch = next(SFTLoader(examples, seq_len=128, batch_size=4, seed=7))
    mask = batch["conv_ids"] >= 0
    logp, ids = cache.lookup(batch["conv_ids"], batch["position_ids"], mask, 8)
    with torch.no_grad():
        logits = teacher(batch["input_ids"], doc_ids=batch["doc_ids"]).logits[mask]
    ref_logp, ref_ids = torch.log_softmax(logits.float(), -1).topk(8, dim=-1)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    assert (ids == ref_ids).float().mean() > 0.99  # ties may swap
    # a smaller k reads the first columns
    logp4, _ = cache.lookup(batch["conv_ids"], batch["position_ids"], mask, 4)
    torch.testing.assert_close(logp4, logp[:, :4])
    with pytest.raises(ValueError, match="exceeds the cache's k=8"):
        cache.lookup(batch["conv_ids"], batch["position_ids"], mask, 9)

    # an interrupted build: shard 1 never finished; the rerun writes only it, the same bytes
    before = np.load(root / "train/shard_00001.logp.npy")
    meta = json.loads((root / "meta.json").read_text())
    meta["sets"]["train"]["done"] = [0, 2]
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "train/shard_00001.logp.npy").unlink()
    with pytest.raises(ValueError, match="unfinished"):
        TeacherTopK(root, "train", examples)
    again = build_teacher_cache(
        root, teacher, {"train": examples}, spec, seq_len=128, progress=False
    )
    assert (again["shards_written"], again["shards_skipped"]) == (1, 2)
    np.testing.assert_array_equal(np.load(root / "train/shard_00001.logp.npy"), before)

    # other conversations, another k: refused with a message
    with pytest.raises(ValueError, match="other conversations"):
        TeacherTopK(root, "train", examples[:39])
    with pytest.raises(ValueError, match="another teacher, k"):
        build_teacher_cache(
            root,
            teacher,
            {"train": examples},
            CacheSpec(teacher=teacher_path, k=4, vocab_size=258, examples_per_shard=16),
            seq_len=128,
            progress=False,
        )
    shutil.rmtree(root)


@pytest.mark.parametrize("dtype,atol", [("float16", 2e-2), ("bfloat16", 1.5e-1)])
def test_sixteen_bit_log_probs_stay_close(tmp_path, dtype, atol):
    teacher_path = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=2, sharpen=10.0)
    teacher = load_model(teacher_path).eval()
    _, examples = _examples(tmp_path)
    examples = examples[:8]
    exact, half = tmp_path / "exact", tmp_path / dtype
    for root, dt in ((exact, "float32"), (half, dtype)):
        spec = CacheSpec(teacher=teacher_path, k=16, vocab_size=258, logprob_dtype=dt)
        build_teacher_cache(root, teacher, {"train": examples}, spec, seq_len=128, progress=False)
    batch = next(SFTLoader(examples, seq_len=128, batch_size=2, sequential=True))
    mask = batch["conv_ids"] >= 0
    a, ia = TeacherTopK(exact, "train", examples).lookup(
        batch["conv_ids"], batch["position_ids"], mask, 16
    )
    b, ib = TeacherTopK(half, "train", examples).lookup(
        batch["conv_ids"], batch["position_ids"], mask, 16
    )
    assert torch.equal(ia, ib) and b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=atol, rtol=0)
    assert (np.load(half / "train/shard_00000.logp.npy").itemsize, dtype) in ((2, dtype),)


def test_cache_config_errors(tmp_path):
    run = offline_run(tmp_path, "")
    run.distill.teacher_cache = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no teacher cache at"):
        run_distill(run)
    run.distill.objective = "skew_reverse_kl"
    with pytest.raises(ValueError, match="needs the teacher's full distribution"):
        run_distill(run)
    run.distill.teacher_cache = ""
    with pytest.raises(ValueError, match="distill.teacher .* or distill.teacher_cache"):
        run_distill(run)


# ---------------------------------------------------------------------- pretraining text
def _text_run(tmp_path, out, teacher, *, steps=4, top_k=258):
    """A tiny pretraining run distilling from `teacher` on documents split into several
    pieces (seq_len 32), over shards of 16 documents."""
    from hybridlm.data.config import SourceConfig
    from hybridlm.data.pipeline import build_source
    from hybridlm.data.shards import write_shards
    from hybridlm.data.tokenizer import ByteTokenizer

    run = tiny_run(
        tmp_path,
        out,
        max_steps=steps,
        eval_interval=2,
        checkpoint_interval=0,
        intra_doc_masking=True,
    )
    shards = tmp_path / "text_shards"
    if not shards.exists():
        write_shards(build_source(run.data.sources[0]), ByteTokenizer(), shards, shard_docs=16)
    run.data.sources = [SourceConfig(name="t", kind="shards", path=str(shards))]
    run.distill.teacher, run.distill.top_k = teacher, top_k
    return run


def test_pretraining_distillation_from_the_cache_equals_online_for_k_equal_vocab(tmp_path, capsys):
    from hybridlm.train.stages.pretrain import run_pretrain

    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    online = _text_run(tmp_path, "online", teacher)
    run_pretrain(online)
    cached = _text_run(tmp_path, "cached", teacher)
    cached.distill.teacher_cache = str(tmp_path / "cache")
    path = tmp_path / "pretrain.yaml"
    cached.save(path)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["distill-cache", "--pretraining", "--config", str(path)])
    args.fn(args)
    printed = capsys.readouterr().out
    built = json.loads(printed[printed.index("{\n") :])
    assert built["shards_written"] == 3 and built["bytes_per_token"] == 258 * 8
    cached.distill.teacher = ""  # the cache stands in for the teacher: never loaded
    run_pretrain(cached)

    def rows(run):
        return read_metrics(f"{run.train.out_dir}/metrics.jsonl")

    a = [r for r in rows(online) if r["kind"] in ("train", "eval")]
    b = [r for r in rows(cached) if r["kind"] in ("train", "eval")]
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]
    assert all("kl" in r for r in a if r["kind"] == "train")
    assert all("eval_kl" in r for r in a if r["kind"] == "eval")
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "kl", "ce", "eval_kl", "eval_loss"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-6, (key, ra["step"], ra[key], rb[key])


def test_pretraining_loss_is_the_weighted_kl_and_ce(tmp_path):
    """One step's loss by hand: kl_weight * KL(teacher || student) + ce_weight * CE + MTP."""
    from hybridlm.data.pipeline import build_loaders, prepare_shards
    from hybridlm.train.objectives import causal_lm_loss
    from hybridlm.train.text_training import pretrain_trainer

    teacher_path = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    run = _text_run(tmp_path, "one", teacher_path, steps=1, top_k=0)
    run.distill.kl_weight, run.distill.ce_weight = 0.7, 0.2
    trainer = pretrain_trainer(run)
    module = trainer.module
    batch = next(build_loaders(run.data, prepare_shards(run.data))[0])
    student = module.model
    teacher = load_model(teacher_path).eval()
    with torch.no_grad():
        denom = int(batch["num_valid_tokens"])
        out = student(batch["input_ids"], doc_ids=batch["doc_ids"], mtp_depth=2)
        base, parts = causal_lm_loss(
            student,
            out,
            batch["labels"],
            doc_ids=batch["doc_ids"],
            num_valid_tokens=denom,
            include_aux=False,
        )
        t = teacher(batch["input_ids"], doc_ids=batch["doc_ids"]).logits
        mask = torch.zeros_like(batch["labels"], dtype=torch.bool)
        mask[:, :-1] = batch["labels"][:, 1:] != -100
        p = torch.softmax(t[mask].double(), -1)
        kl = (p * (p.log() - torch.log_softmax(out.logits[mask].double(), -1))).sum() / denom
        want = base + 0.7 * kl - 0.8 * parts["ce"]
        step = module.prepare_step(0)
        got = module.loss(step.micro[0], step)
    assert abs(float(got.value) - float(want)) < 1e-5, (float(got.value), float(want))
    assert abs(got.metrics["kl"] - float(kl)) < 1e-6


def test_text_cache_entries_are_each_pieces_top_k_and_resume_by_shard(tmp_path):
    from hybridlm.data.loader import PackedLoader
    from hybridlm.data.shards import ShardSet
    from hybridlm.train.teacher_cache import TextTeacherTopK, build_text_teacher_cache

    teacher_path = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=2, sharpen=10.0)
    teacher = load_model(teacher_path).eval()
    run = _text_run(tmp_path, "unused", teacher_path)
    shards = ShardSet(run.data.sources[0].path)
    spec = CacheSpec(teacher=teacher_path, k=8, vocab_size=258)
    root = tmp_path / "cache"
    first = build_text_teacher_cache(root, teacher, {"t": shards}, spec, seq_len=32, progress=False)
    assert first["shards_written"] == 3 and first["tokens"] == shards.num_tokens
    cache = TextTeacherTopK(root, {"t": shards}, seq_len=32)
    # a shuffled training batch, packed otherwise than the cache's pass: the same entries
    batch = next(PackedLoader(shards, seq_len=32, batch_size=6, seed=3))
    mask = batch["targets"] != -100
    logp, ids = cache.lookup(["t"], batch["source_ids"], batch["token_index"], mask, 8)
    with torch.no_grad():
        logits = teacher(batch["input_ids"], doc_ids=batch["doc_ids"]).logits[mask]
    ref_logp, ref_ids = torch.log_softmax(logits.float(), -1).topk(8, dim=-1)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    assert (ids == ref_ids).float().mean() > 0.99  # ties may swap
    assert (batch["position_ids"][mask] > 0).any()  # pieces after a document's first

    # an interrupted build: shard 1 never finished; the rerun writes only it, the same bytes
    before = np.load(root / "t/shard_00001.logp.npy")
    meta = json.loads((root / "meta.json").read_text())
    meta["sets"]["t"]["done"] = [0, 2]
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "t/shard_00001.logp.npy").unlink()
    with pytest.raises(ValueError, match="unfinished"):
        TextTeacherTopK(root, {"t": shards}, seq_len=32)
    again = build_text_teacher_cache(root, teacher, {"t": shards}, spec, seq_len=32, progress=False)
    assert (again["shards_written"], again["shards_skipped"]) == (1, 2)
    np.testing.assert_array_equal(np.load(root / "t/shard_00001.logp.npy"), before)
    # other pieces (seq_len), another k, other shards: refused with a message
    with pytest.raises(ValueError, match="built for seq_len 32"):
        TextTeacherTopK(root, {"t": shards}, seq_len=64)
    with pytest.raises(ValueError, match="another teacher, k, dtype, seq_len"):
        build_text_teacher_cache(
            root, teacher, {"t": shards}, CacheSpec(teacher_path, 4, 258), seq_len=32
        )
    with pytest.raises(ValueError, match="has no source 'u'"):
        TextTeacherTopK(root, {"u": shards}, seq_len=32)

    # two sources; a loader over only the second: its source_ids index its own names
    from hybridlm.data.shards import write_shards
    from hybridlm.data.sources import Document, IterableSource
    from hybridlm.data.tokenizer import ByteTokenizer

    docs = [Document(f"o{i}", "other text, " * (i + 5), "o") for i in range(6)]
    write_shards(IterableSource(docs, name="o"), ByteTokenizer(), tmp_path / "other")
    other = ShardSet(tmp_path / "other")
    both = tmp_path / "cache2"
    build_text_teacher_cache(
        both, teacher, {"t": shards, "o": other}, spec, seq_len=32, progress=False
    )
    batch = next(PackedLoader({"o": other}, seq_len=32, batch_size=2, seed=0))
    mask = batch["targets"] != -100
    got, _ = TextTeacherTopK(both, {"t": shards, "o": other}, seq_len=32).lookup(
        ["o"], batch["source_ids"], batch["token_index"], mask, 8
    )
    with torch.no_grad():
        logits = teacher(batch["input_ids"], doc_ids=batch["doc_ids"]).logits[mask]
    torch.testing.assert_close(got, torch.log_softmax(logits, -1).topk(8, -1)[0], atol=1e-5, rtol=0)


def test_pretraining_distillation_errors(tmp_path):
    from hybridlm.train.stages.pretrain import run_pretrain

    run = _text_run(tmp_path, "err", "")
    run.distill.teacher_cache = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no teacher cache at"):
        run_pretrain(run)
    run.train.intra_doc_masking = False
    with pytest.raises(ValueError, match="needs train.intra_doc_masking, data.packing best_fit"):
        run_pretrain(run, overwrite=True)
