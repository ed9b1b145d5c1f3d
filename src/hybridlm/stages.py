"""The registry of the model flow's stages, in chain order (SPEC §5): each line is the `STAGE`
object of the module that runs it (the contract: `hybridlm.stage`). The speedrun runs them in
this order, the report renders their headlines in it, and the speedrun config has one section
per stage that has a config. A new stage is its module's `STAGE` and one line here.
"""

from __future__ import annotations

from .curate import pipeline as curate
from .data import tokenizer_stage as tokenizer
from .eval import flow as eval_
from .eval import long_context
from .report import card as report
from .rl import learner as rl
from .rl import mtp_heal
from .stage import Stage
from .train.stages import pretrain, qad, quantize, sft

STAGES: tuple[Stage, ...] = (
    curate.STAGE,  # <run>/curate/data
    tokenizer.STAGE,  # <run>/tokenizer
    pretrain.STAGE,  # <run>/pretrain
    pretrain.MIDTRAIN,  # <run>/midtrain (skipped by default)
    long_context.STAGE,  # <run>/long_context (skipped by default)
    sft.STAGE,  # <run>/sft
    rl.STAGE,  # <run>/rl/model
    mtp_heal.STAGE,  # <run>/mtp_heal/model
    quantize.STAGE,  # <run>/quantize/<recipe>
    qad.STAGE,  # <run>/qad/hf
    eval_.STAGE,  # <run>/eval
    report.STAGE,  # <run>/report.md, report.html
)
STAGE_NAMES = tuple(s.name for s in STAGES)
# stages whose output is a model, in chain order (each starts from the newest one before it)
MODEL_STAGES = tuple(s.name for s in STAGES if s.model)
BY_NAME = {s.name: s for s in STAGES}
