"""Every shipped YAML under configs/ loads with the class that reads it, and round-trips."""

from pathlib import Path

import pytest

from hybridlm.config import ModelConfig, read_mapping
from hybridlm.curate.pipeline import CurateConfig
from hybridlm.eval.harness import EvalConfig
from hybridlm.rl.learner import RLRunConfig
from hybridlm.speedrun import SpeedrunConfig
from hybridlm.train.config import RunConfig
from hybridlm.train.stages.distill import DistillRunConfig
from hybridlm.train.stages.dpo import DPORunConfig
from hybridlm.train.stages.qad import QADRunConfig
from hybridlm.train.stages.rm import RMRunConfig
from hybridlm.train.stages.sft import SFTRunConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
READERS = {
    "quickstart": RunConfig,
    "midtrain": RunConfig,
    "long_context": RunConfig,
    "sft": SFTRunConfig,
    "sft_tools": SFTRunConfig,
    "dpo": DPORunConfig,
    "distill": DistillRunConfig,
    "qad": QADRunConfig,
    "rl": RLRunConfig,
    "rl_tools": RLRunConfig,
    "rlhf": RLRunConfig,
    "rm": RMRunConfig,
    "curate": CurateConfig,
    "speedrun": SpeedrunConfig,
    "eval": EvalConfig,
}


def test_every_recipe_has_a_reader():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(READERS)


@pytest.mark.parametrize("name", sorted(READERS))
def test_recipe_loads_and_round_trips(name, tmp_path):
    cls = READERS[name]
    path = CONFIGS / f"{name}.yaml"
    cfg = cls.load(path)
    for suffix in (".yaml", ".json"):
        cfg.save(tmp_path / f"c{suffix}")
        again = cls.from_dict(read_mapping(tmp_path / f"c{suffix}"))
        assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_configs_load(path):
    assert isinstance(ModelConfig.load(path), ModelConfig)
