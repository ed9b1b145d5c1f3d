"""Training: the one `Trainer` (train.trainer) and its stages (pretrain, sft, dpo, distill,
mtp_boost), typed run config, AdamW param groups, LR schedules, checkpoints.

from hybridlm.train import RunConfig, run_pretrain
cfg = RunConfig.load("configs/quickstart.yaml")
result = run_pretrain(cfg)              # or run_pretrain(cfg, resume=True)
"""

from .config import RunConfig, TrainConfig
from .text_training import pretrain_trainer, run_pretrain
from .trainer import Trainer, TrainModule

__all__ = [
    "RunConfig",
    "TrainConfig",
    "TrainModule",
    "Trainer",
    "pretrain_trainer",
    "run_pretrain",
]
