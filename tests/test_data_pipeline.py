"""DataConfig (YAML round trip, validation messages) and the pipeline from a config to loaders."""

import json

import pytest
import torch
import yaml

from hybridlm.data.bpe import BPETokenizer
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.data.loader import IGNORE_INDEX, Phase
from hybridlm.data.pipeline import build_loaders, build_source, prepare_shards
from hybridlm.data.sources import StdlibSource


def _config(tmp_path, **kw):
    (tmp_path / "txt").mkdir(exist_ok=True)
    for i in range(30):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(f"Story {i}. " + "Once upon a time. " * i)
    rows = [
        {"id": i, "text": f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 4)} for i in range(40)
    ]
    (tmp_path / "code.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    base = dict(
        sources=[
            SourceConfig(name="stories", kind="text", path=str(tmp_path / "txt"), weight=0.6),
            SourceConfig(name="code", kind="jsonl", path=str(tmp_path / "code.jsonl"), weight=0.4),
        ],
        tokenizer=str(tmp_path / "tok"),
        tokenizer_vocab_size=400,
        shards_dir=str(tmp_path / "shards"),
        seq_len=48,
        batch_size=2,
        eval_fraction=0.1,
    )
    return DataConfig(**{**base, **kw})


def test_yaml_round_trip(tmp_path):
    cfg = _config(
        tmp_path,
        phases=[
            Phase(fraction=0.8, weights={"stories": 1.0, "code": 0.5}),
            Phase(fraction=0.2, weights={"code": 1.0}),
        ],
        total_tokens=10_000,
        packing="greedy",
    )
    cfg.save(tmp_path / "data.yaml")
    again = DataConfig.load(tmp_path / "data.yaml")
    assert again == cfg and isinstance(again.phases[0], Phase)
    assert isinstance(again.sources[1], SourceConfig) and again.weights == {
        "stories": 0.6,
        "code": 0.4,
    }
    cfg.save(tmp_path / "data.json")
    assert DataConfig.load(tmp_path / "data.json") == cfg
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"data": cfg.to_dict()}))
    assert DataConfig.load(tmp_path / "recipe.yaml") == cfg
    assert DataConfig().sources[0].kind == "stdlib"  # the embedded default


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sources": []}, "at least one source"),
        ({"sources": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"sources": [{"name": "a", "kind": "jsonl"}]}, "needs a path"),
        ({"sources": [{"name": "a", "kind": "csv"}]}, "must be one of"),
        ({"sources": [{"name": "a", "weight": -1}]}, "weight must be >= 0"),
        ({"seq_len": 0}, "seq_len must be positive"),
        ({"seq_len": "long"}, "must be an integer"),
        ({"packing": "random"}, "must be one of"),
        ({"tokenizer_vocab_size": 1000}, "set data.tokenizer to the directory"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"phases": [{"fraction": 0.5, "weights": {"stdlib": 1}}]}, "sum to 1"),
        (
            {"phases": [{"fraction": 0.5, "weights": {}}, {"fraction": 0.5, "weights": {}}]},
            "total_tokens",
        ),
        ({"phases": [{"fraction": 1.0, "weights": {"web": 1}}]}, "unknown sources"),
        ({"bogus": 1}, "unknown key"),
    ],
)
def test_validation_messages(change, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict(change)


def test_config_to_loaders(tmp_path):
    cfg = _config(tmp_path)
    sets = prepare_shards(cfg)
    assert set(sets) == {"stories", "code"}
    tok = BPETokenizer.load(tmp_path / "tok")  # trained from the sources and saved
    assert 268 < tok.vocab_size <= 400  # a tiny corpus has fewer merges than asked for
    assert sets["code"].tokenizer_sha256 == tok.sha256
    assert len(sets["stories"]) == 30 and len(sets["code"]) == 40
    again = prepare_shards(cfg)  # resumable: nothing is redone
    assert again["code"].manifest == sets["code"].manifest

    train, held = build_loaders(cfg, sets, rank=1, world_size=2)
    assert held is not None
    batch = next(train)
    assert batch["input_ids"].shape == (2, 48)
    text = tok.decode(batch["input_ids"][batch["source_ids"] >= 0].tolist())
    assert "Once upon a time" in text or "return x +" in text
    held_tokens = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in held)
    assert held_tokens > 0
    state = train.state_dict()
    resumed, _ = build_loaders(cfg, sets, rank=1, world_size=2)
    resumed.load_state_dict(state)
    expected = next(train)
    assert torch.equal(next(resumed)["input_ids"], expected["input_ids"])

    # a zero weight leaves a source out of training
    code = SourceConfig(name="code", kind="jsonl", path=cfg.sources[1].path, weight=0.0)
    zero = _config(tmp_path, sources=[cfg.sources[0], code])
    only, _ = build_loaders(zero, sets)
    assert only.names == ["stories"]
    with pytest.raises(ValueError, match="prepare_shards"):
        build_loaders(cfg, {"stories": sets["stories"]})


def test_build_source_kinds(tmp_path):
    cfg = _config(tmp_path)
    assert [d.text[:5] for d in build_source(cfg.sources[0])][:2] == ["Story", "Story"]
    stdlib = build_source(SourceConfig(name="py", kind="stdlib", max_files=3, docstrings_only=True))
    assert isinstance(stdlib, StdlibSource) and len(stdlib.files) == 3
    with pytest.raises(ValueError, match="no document source"):
        build_source(SourceConfig(name="s", kind="shards", path="x"))


def test_tinyshakespeare_and_stdlib_curriculum(tmp_path):
    cfg = DataConfig(
        sources=[
            # no path: the packaged copy
            SourceConfig(name="shakespeare", kind="tinyshakespeare", group_chars=1000),
            SourceConfig(name="python", kind="stdlib", max_files=40, docstrings_only=True),
        ],
        tokenizer=str(tmp_path / "tok"),
        tokenizer_vocab_size=512,
        tokenizer_train_chars=400_000,
        shards_dir=str(tmp_path / "shards"),
        seq_len=128,
        batch_size=4,
        phases=[
            Phase(fraction=0.5, weights={"shakespeare": 1.0}),
            Phase(fraction=0.5, weights={"python": 1.0}),
        ],
        total_tokens=10 * 4 * 128,
        num_workers=2,
    )
    sets = prepare_shards(cfg)
    train, _ = build_loaders(cfg, sets)
    tok = BPETokenizer.load(tmp_path / "tok")
    batches = [next(train) for _ in range(10)]
    first = tok.decode(batches[0]["input_ids"][0].tolist())
    assert any(w in first for w in ("thou", "thee", "the", "And", "my"))
    assert set(batches[0]["source_ids"].flatten().tolist()) <= {0, -1}
    assert set(batches[-1]["source_ids"].flatten().tolist()) <= {1, -1}
