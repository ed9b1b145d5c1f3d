"""Sharded training checkpoints (torch.distributed.checkpoint, `train.distributed.dcp`): an FSDP2
world-2 run writes one shard file per rank (nothing gathered onto rank 0); the checkpoint resumes at
world 1 without a process group and at world 2 with the losses of an uninterrupted world-1
run; a world-1 sharded checkpoint resumes under FSDP2 and DDP, a full one under FSDP2; a crash
before the rename leaves no checkpoint, damage is found; `hybridlm.io` consolidates it into a
model; `export-hf` streams it into a transformers directory tensor by tensor."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.io import load, load_model
from hybridlm.io.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    resume_checkpoint,
    verify_checkpoint,
)
from hybridlm.io.sharded import iter_model_tensors, model_tensor_specs
from hybridlm.model.model import HybridLM
from hybridlm.train.config import TrainConfig
from hybridlm.train.distributed.dcp import load_sharded, save_sharded
from hybridlm.train.stages.pretrain import run_pretrain
from test_train_parallel import (
    PRETRAIN_KEYS,
    assert_same_losses,
    assert_same_weights,
    rows,
    run_world2,
    tiny_run,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = dict(max_steps=4, eval_interval=2, checkpoint_interval=2)
SHARDED = "hybridlm-train-checkpoint-sharded"


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted world-1 reference (full checkpoints at steps 2 and 4) and an FSDP2
    world-2 run stopped after its sharded checkpoint at step 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("dcp")
    ref = tiny_run(tmp, "ref", batch_size=4, **STEPS)
    run_pretrain(ref)
    part = tiny_run(tmp, "part", batch_size=2, parallel="fsdp", **STEPS)  # auto: sharded
    run_world2(tmp, part, until_step=2)
    torch.set_num_threads(before)
    return tmp, Path(ref.train.out_dir), Path(part.train.out_dir)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_fsdp2_sharded_save_writes_each_ranks_shards_without_a_gather(runs):
    _, _, part = runs
    ckpt = latest_checkpoint(part)
    assert ckpt.name == "step_00000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]  # no gathered file
    meta = verify_checkpoint(ckpt)
    assert meta["format"] == SHARDED and meta["format_version"] == 1
    assert meta["step"] == 2 and meta["world_size"] == 2 and len(meta["rng"]) == 2
    assert meta["loader"] and meta["run_config"]["train"]["parallel"] == "fsdp"
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # each rank wrote its own half of every parameter and of its AdamW moments (FSDP2's Shard(0)
    # chunks, found in DCP's index), nothing whole: no gather onto rank 0
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    index = FileSystemReader(ckpt).read_metadata()
    params = {n for n, p in _model_with_mtp().named_parameters() if p.shape[0] >= 2}
    payload = {"__0_0.distcp": 0, "__1_0.distcp": 0}
    sharded = 0
    for key, md in index.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue  # param groups: pickled values
        files = []
        for chunk in md.chunks:
            files.append(index.storage_data[MetadataIndex(key, chunk.offsets)].relative_path)
            payload[files[-1]] += chunk.sizes.numel() * md.properties.dtype.itemsize
        name = key.removeprefix("model.").removeprefix("optim.state.")
        if name.rsplit(".", 1)[0] in params or name in params:  # a weight or its moment
            if not name.endswith(".step"):
                assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], key
                sharded += 1
    state = 3 * 4 * _model_with_mtp().count_params()  # fp32 weights, exp_avg, exp_avg_sq
    sizes = {f: (ckpt / f).stat().st_size for f in payload}
    print(f"shard files {sizes} bytes holding {payload} bytes of tensors; state {state} bytes")
    assert sharded == 3 * len(params)
    assert state <= sum(payload.values()) < 1.01 * state
    assert all(0.45 < b / sum(payload.values()) < 0.55 for b in payload.values())


def _model_with_mtp() -> HybridLM:
    with torch.device("meta"):
        return HybridLM(tiny_train_model())


def test_fsdp2_sharded_checkpoint_resumes_at_world1(runs):
    """World 2 -> world 1: no process group at all; DCP consolidates each tensor on read."""
    tmp, ref, part = runs
    out = _copy(part, tmp / "to_w1")
    run_pretrain(tiny_run(tmp, "to_w1", batch_size=4, **STEPS), resume=True)
    worst = assert_same_losses(rows(out), rows(ref), PRETRAIN_KEYS)
    weights = assert_same_weights(out, ref)
    print(f"fsdp2 world 2 -> world 1: worst relative difference {worst:.2e}, weights {weights:.2e}")
    # the resumed single-process run writes full checkpoints again ("auto")
    assert (out / "checkpoints" / "step_00000004" / "model.safetensors").is_file()


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_fsdp2_sharded_checkpoint_resumes_at_world2(runs, parallel):
    """World 2 -> world 2 under FSDP2 (each rank reads its own chunks back, restores its own RNG)
    and under DDP (each rank reads whole tensors from both ranks' files)."""
    tmp, ref, part = runs
    out = _copy(part, tmp / f"to_{parallel}")
    run = tiny_run(tmp, out.name, batch_size=2, parallel=parallel, **STEPS)
    run_world2(tmp, run, resume=True)
    worst = assert_same_losses(rows(out), rows(ref), PRETRAIN_KEYS)
    weights = assert_same_weights(out, ref)
    print(
        f"fsdp2 world 2 -> {parallel} world 2: worst relative difference {worst:.2e}, {weights:.2e}"
    )
    fmt = read_meta(latest_checkpoint(out))["format"]  # "auto": DDP saves full checkpoints
    assert fmt == ("hybridlm-train-checkpoint" if parallel == "ddp" else SHARDED)


def test_world1_sharded_checkpoint_resumes_into_fsdp2_at_world2(runs):
    """World 1 (sharded by choice, plain tensors) -> FSDP2 world 2 (each rank its chunks)."""
    tmp, ref, _ = runs
    one = tiny_run(tmp, "w1", batch_size=4, checkpoint_format="sharded", **STEPS)
    run_pretrain(one, until_step=2)
    assert read_meta(latest_checkpoint(one.train.out_dir))["world_size"] == 1
    run_world2(tmp, tiny_run(tmp, "w1", batch_size=2, parallel="fsdp", **STEPS), resume=True)
    worst = assert_same_losses(rows(one.train.out_dir), rows(ref), PRETRAIN_KEYS)
    weights = assert_same_weights(one.train.out_dir, ref)
    print(f"sharded world 1 -> fsdp world 2: worst relative difference {worst:.2e}, {weights:.2e}")


def test_full_checkpoint_resumes_into_fsdp2(runs):
    """A full (single-process) checkpoint resumes into a sharded run; its next is sharded."""
    tmp, ref, _ = runs
    out = tmp / "full_to_fsdp"
    out.mkdir()
    (out / "checkpoints").mkdir()
    shutil.copytree(ref / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    lines = (ref / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # truncated on resume
    run_world2(tmp, tiny_run(tmp, out.name, batch_size=2, parallel="fsdp", **STEPS), resume=True)
    assert_same_losses(rows(out), rows(ref), PRETRAIN_KEYS)
    assert_same_weights(out, ref)
    assert read_meta(latest_checkpoint(out))["format"] == SHARDED


def test_sharded_checkpoint_loads_as_a_model(runs):
    """`hybridlm.io` consolidates both ranks' shards: the weights of the world-1 run at the same
    step (equal up to the reduction order of the gradient sums)."""
    _, ref, part = runs
    loaded = load(part)  # the run directory: its newest checkpoint
    assert loaded.kind == "checkpoint" and loaded.path.name == "step_00000002"
    assert loaded.meta["step"] == 2 and not loaded.model.training
    theirs = load_model(ref / "checkpoints" / "step_00000002")
    worst = 0.0
    for (name, a), b in zip(
        loaded.model.state_dict().items(), theirs.state_dict().values(), strict=True
    ):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        worst = max(worst, float((a - b).abs().max()))
    print(f"consolidated world-2 weights vs world-1 weights: max abs difference {worst:.2e}")
    assert worst < 1e-4  # a misplaced shard differs by the weights' scale (~2e-2)
    specs = model_tensor_specs(loaded.path)
    assert set(specs) == set(theirs.state_dict())
    name, t = next(iter_model_tensors(loaded.path, ["embeddings.weight"]))
    assert torch.equal(t, loaded.model.embeddings.weight)


# ---------------------------------------------------------------------------- in one process
def _model(seed: int = 0) -> HybridLM:
    return HybridLM(tiny_train_model(mtp=False), seed=seed)


def _save(out: Path, step: int, model, opt=None, **kw) -> Path:
    meta = {"run_config": {"model": model.config.to_dict(), "data": {"tokenizer": "byte"}}}
    return save_sharded(out, step=step, model=model, optimizer=opt, meta=meta, **kw)


def _trained(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 258, (2, 16))
    model(x).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_single_process_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model, opt = _trained()
    torch.manual_seed(3)
    path = _save(tmp_path, 1, model, opt)
    expected = torch.rand(3)
    other = _model(seed=1)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    meta = load_sharded(path, other, opt2)
    assert meta["step"] == 1 and torch.equal(torch.rand(3), expected)
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    assert opt2.state_dict()["param_groups"][0]["lr"] == 1e-3
    # io.load_model consolidates it; io.checkpoint's full-format loader says what to use instead
    with torch.no_grad():
        x = torch.randint(0, 258, (1, 6))
        ref = model.eval()(x).logits
        torch.testing.assert_close(load_model(path)(x).logits, ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="sharded checkpoint: hybridlm.io.load_model"):
        load_checkpoint(path, _model())
    cfg = tiny_train_model(mtp=False)
    cfg.d_model = 32
    cfg.validate()
    with pytest.raises(ValueError, match="does not match the model"):
        load_sharded(path, HybridLM(cfg, seed=0))
    weights_only = _save(tmp_path / "w", 1, model)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_sharded(weights_only, _model(), torch.optim.AdamW(_model().parameters()))


def test_merge_reads_sharded_checkpoints(tmp_path):
    """`hybridlm merge` averages sharded checkpoints like full ones (read offline)."""
    from hybridlm.train.checkpoint import merge_checkpoints

    a, b = _model(seed=0), _model(seed=1)
    paths = [_save(tmp_path, 1, a), _save(tmp_path, 2, b)]
    merged = merge_checkpoints(paths, "uniform")
    want = {k: (v + b.state_dict()[k]) / 2 for k, v in a.state_dict().items()}
    assert merged.keys() == want.keys()
    # relative: an average of two fp32 tensors rounds once (<= 1 ulp, 1.2e-7); the weights go down
    # to ~1e-7, which an absolute 1e-7 did not compare at all (measured: equal)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=2.4e-7, atol=0)


def test_partial_save_is_never_used_and_damage_is_found(tmp_path, monkeypatch):
    model, opt = _trained()
    for step in (1, 2, 3):
        _save(tmp_path, step, model, opt, keep_last_n=3)
    root = checkpoint_dir(tmp_path)
    # killed before the rename: the shards and even meta.json of step 4 stay in .tmp-*
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, model, opt)
    monkeypatch.undo()
    (torn,) = root.glob(".tmp-step_00000004-*")
    assert (torn / "meta.json").is_file() and (torn / ".metadata").is_file()
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    # damage: same size (only the checksum tells), truncated, missing
    _flip_byte(root / "step_00000003" / "__0_0.distcp", offset=1000)
    metadata = root / "step_00000002" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"\.metadata has .* bytes"):
        verify_checkpoint(root / "step_00000002")
    lines: list[str] = []
    assert resume_checkpoint(tmp_path, log=lines.append) == root / "step_00000001"
    assert "step_00000003" in lines[0] and "__0_0.distcp does not match its SHA-256" in lines[0]
    assert "step_00000002" in lines[1] and ".metadata has" in lines[1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    (root / "step_00000001" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        verify_checkpoint(root / "step_00000001")
    # the next save removes the leftover; keep-last-N prunes sharded checkpoints too
    for step in (5, 6):
        _save(tmp_path, step, model, opt, keep_last_n=2)
    assert not torn.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]


def test_tied_embeddings_load_and_export_from_both_formats(tmp_path):
    """A tied LM head: stored under both names by DCP, once in model.safetensors; both formats
    load as a tied model (`io.load_model`), and the streamed export stores it once."""
    from hybridlm.interop.hf import load_pretrained
    from hybridlm.io.checkpoint import save_checkpoint
    from hybridlm.io.sharded import export_pretrained

    cfg = tiny_train_model(mtp=False)
    cfg.tie_embeddings = True
    cfg.validate()
    model = HybridLM(cfg, seed=0).eval()
    meta = {"run_config": {"model": cfg.to_dict()}}
    full = save_checkpoint(tmp_path / "full", step=1, model=model, optimizer=None, meta=meta)
    sharded = save_sharded(tmp_path / "dcp", step=1, model=model, optimizer=None, meta=meta)
    export_pretrained(sharded, tmp_path / "hf")
    x = torch.randint(0, 258, (1, 8))
    with torch.no_grad():
        ref = model(x).logits
        for m in (load_model(full), load_model(sharded), load_pretrained(tmp_path / "hf")):
            assert m.lm_head.weight is m.embeddings.weight
            torch.testing.assert_close(m.eval()(x).logits, ref, atol=0, rtol=0)


def test_checkpoint_format_is_validated():
    assert TrainConfig().checkpoint_format == "auto"
    with pytest.raises(ValueError, match="train.checkpoint_format must be 'auto', 'full' or"):
        TrainConfig(checkpoint_format="dcp")


# ---------------------------------------------------------------------------- export-hf
def test_export_hf_of_a_sharded_checkpoint_loads_in_transformers(runs, capsys):
    transformers = pytest.importorskip("transformers")
    from hybridlm.cli import main

    tmp, _, part = runs
    ckpt = latest_checkpoint(part)
    assert main(["export-hf", "--checkpoint", str(ckpt), "--out", str(tmp / "hf")]) == 0
    assert "streamed from the sharded" in capsys.readouterr().out
    ours = load_model(ckpt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
    x = torch.randint(0, 258, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x).logits, atol=1e-5, rtol=1e-4)
    # and back: the streamed directory is the consolidated model for hybridlm too
    again, want = load_model(tmp / "hf").state_dict(), ours.state_dict()
    assert set(again) == set(want) and all(torch.equal(again[k], want[k]) for k in want)


def _big_model() -> HybridLM:
    """~18M parameters (68 MiB fp32) in 100 tensors, the largest 2.1 MiB (3%)."""
    m = tiny_train_model(mtp=False)
    m.d_model, m.pattern = 512, "ME*-" * 4
    m.mamba.num_heads, m.mamba.head_dim = 8, 64
    m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim = 8, 4, 64
    m.moe.num_experts, m.moe.expert_hidden, m.moe.latent_size = 16, 256, 128
    m.moe.shared_expert_hidden, m.mlp.hidden = 512, 1024
    m.validate()
    return HybridLM(m, seed=0)


PEAK = textwrap.dedent(
    """
    import re, sys, torch
    import torch.distributed.checkpoint, torch.distributed.checkpoint.state_dict_loader
    from hybridlm.interop.hf import save_pretrained
    from hybridlm.io import load_model
    from hybridlm.io.checkpoint import checkpoint_model_config
    from hybridlm.io.sharded import export_pretrained
    from hybridlm.model.model import HybridLM

    def kib(key):
        return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

    def peak(fn):
        open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the RSS
        base = kib("VmRSS")
        fn()
        return 1024 * (kib("VmHWM") - base)

    ckpt, out = sys.argv[1], sys.argv[2]
    with torch.device("meta"):  # the first model built imports ~800 modules (~75 MiB)
        HybridLM(checkpoint_model_config(ckpt))
    print(peak(lambda: export_pretrained(ckpt, out + "/stream")))
    print(peak(lambda: save_pretrained(load_model(ckpt), out + "/whole")))
    """
)


def test_export_hf_streams_tensor_by_tensor(tmp_path):
    """Peak memory of the streaming export: about one tensor (~3x the largest: DCP's target,
    the chunk it reads), not the model as `load_model` + `save_pretrained` need. Measured as the
    RSS high-water mark of a fresh process, reset after the imports; allocations of 64 KiB and
    more are mmap'ed (MALLOC_MMAP_THRESHOLD_) so a freed tensor leaves the RSS at once."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to measure the peak RSS")
    from safetensors import safe_open

    model = _big_model()
    sd = model.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    largest = max(t.numel() * t.element_size() for t in sd.values())
    ckpt = _save(tmp_path, 1, model)
    res = subprocess.run(
        [sys.executable, "-c", PEAK, str(ckpt), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    stream, whole = (int(x) for x in res.stdout.split()[-2:])
    mib = 2**20
    print(
        f"export of a {model_bytes / mib:.1f} MiB model (largest tensor {largest / mib:.1f} "
        f"MiB): streamed peak +{stream / mib:.1f} MiB, load_model + save_pretrained "
        f"+{whole / mib:.1f} MiB"
    )
    assert whole > model_bytes  # the measurement sees a whole model when there is one
    assert stream < model_bytes / 4
    # the streamed file is what save_pretrained writes for the model, tensor for tensor
    from hybridlm.interop.hf import to_hf_state_dict

    expected = to_hf_state_dict(model)
    with safe_open(str(tmp_path / "stream" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected) and f.metadata() == {"format": "pt"}
        for k in expected:
            assert torch.equal(f.get_tensor(k), expected[k]), k
    cfg = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h" and cfg["hidden_size"] == 512


def test_streamed_safetensors_shard_with_an_index(tmp_path):
    """`write_model_dir` of a TensorStream: sharded files + index.json like the in-memory path,
    every dtype safetensors has, 0-d and empty tensors."""
    from safetensors.torch import load_file

    from hybridlm.interop.hf import TensorStream, read_safetensors_dir, write_model_dir

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.tensor(3, dtype=torch.int64),
        "d": torch.zeros(0, 4, dtype=torch.float16),
        "e": torch.tensor([True, False, True]),
        "f": torch.randn(4, 4).to(torch.float8_e4m3fn),
    }
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    stream = TensorStream(specs, lambda: iter(list(tensors.items())))
    write_model_dir(tmp_path / "s", stream, {"vocab_size": 1}, max_shard_bytes=40)
    write_model_dir(tmp_path / "m", tensors, {"vocab_size": 1}, max_shard_bytes=40)
    for d in ("s", "m"):
        index = json.loads((tmp_path / d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        got = read_safetensors_dir(tmp_path / d)
        assert set(got) == set(tensors)
        for k, t in tensors.items():
            assert got[k].dtype == t.dtype and torch.equal(
                got[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)
            ), k
    s_files = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert s_files == sorted(p.name for p in (tmp_path / "m").iterdir())
    shards = [f for f in s_files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(load_file(tmp_path / "s" / f) for f in shards)
