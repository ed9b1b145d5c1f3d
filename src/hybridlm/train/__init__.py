"""Pretraining: typed run config, AdamW param groups, LR schedules, checkpoints, the loop.

from hybridlm.train import RunConfig, run_pretrain
cfg = RunConfig.load("configs/quickstart.yaml")
result = run_pretrain(cfg)              # or run_pretrain(cfg, resume=True)
"""

from .config import RunConfig, TrainConfig, apply_run_overrides
from .trainer import Trainer, run_pretrain

__all__ = ["RunConfig", "TrainConfig", "Trainer", "apply_run_overrides", "run_pretrain"]
