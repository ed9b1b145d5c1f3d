"""The flow's MTP healing stage (Nemotron 3 Super §4.7): after RL the MTP head is re-trained on
the policy's own generations for prompts of the RL environments (`train.mtp_boost`: only the
head trains, the backbone is frozen), and the acceptance of speculative decoding is measured
before and after. It starts from the newest model and writes `<run>/mtp_heal/model`."""

from __future__ import annotations

from typing import Any

from ..stage import Flow, Report, Stage, scalars
from ..train.mtp_boost import MTPBoostRunConfig, boost_checkpoint
from .env_config import environment_prompts


def _settings(flow: Flow) -> dict[str, Any]:
    data = flow.cfg.mtp_heal.to_dict()
    train = {"init_from": flow.model_path("mtp_heal"), "out_dir": str(flow.stage_dir("mtp_heal"))}
    data["train"] |= train
    return data


def _run(flow: Flow) -> dict[str, Any]:
    cfg = MTPBoostRunConfig.from_dict(flow.settings("mtp_heal"))
    src, out = cfg.train.init_from, flow.stage_dir("mtp_heal")
    result = boost_checkpoint(
        cfg,
        progress=flow.progress,
        overwrite=True,
        environment_prompts=environment_prompts,
    )
    al = {
        f"T{r['temperature']:g}": [r["acceptance_length"], a["acceptance_length"]]
        for r, a in zip(result["before"], result["after"], strict=True)
    }
    return {
        "model": str(out / "model"),
        "from": src,
        "draft_len": cfg.mtp_boost.draft_len,
        "acceptance_length": al,  # temperature -> [before, after]
        **scalars(result),
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    return f"AL at draft length {s['draft_len']}, before -> after: " + ", ".join(
        f"{t.replace('T', 'T=')} {b:.2f} -> {a:.2f}" for t, (b, a) in s["acceptance_length"].items()
    )


STAGE = Stage(
    "mtp_heal",
    config=MTPBoostRunConfig,
    settings=_settings,
    run=_run,
    model="model",
    check=lambda section, cfg, stages: section.validate(),
    headline=_headline,
)
