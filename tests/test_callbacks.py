"""The loop's callbacks (`train.callbacks`): when the Trainer calls each of them, in which order,
and what ends up in metrics.jsonl and in `Trainer.train`'s result — on a TrainModule that only
says what a step does (random tokens, next-token CE on a tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from _tiny import tiny_train_model
from hybridlm.model.model import HybridLM
from hybridlm.train.callbacks import (
    AfterUpdate,
    Callback,
    Close,
    DataRow,
    EndRows,
    Export,
    Plot,
    Progress,
    StartRows,
    Summary,
    Throughput,
)
from hybridlm.train.config import TrainConfig
from hybridlm.train.trainer import Loss, Runtime, Step, Trainer, TrainModule

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(Callback):
    """Writes down every call it gets (and the trainer's step then)."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def on_start(self, trainer: Trainer) -> None:
        self.log.append(("on_start", trainer.step))

    def after_update(self, trainer, step, outcome):
        self.log.append(("after_update", trainer.step))
        return {"recorded": 1.0}

    def log_fields(self, trainer, steps, seconds):
        assert seconds > 0
        self.log.append(("log_fields", steps))
        return {"window_steps": steps}

    def on_step(self, trainer: Trainer) -> None:
        self.log.append(("on_step", trainer.step))

    def close(self, trainer: Trainer) -> None:
        self.log.append(("close", trainer.step))

    def on_end(self, trainer: Trainer, result: dict) -> None:
        self.log.append(("on_end", int(trainer.finished)))


class RandomTokens(TrainModule):
    """Next-token CE on seeded random tokens; its evaluation is the loss on a fixed batch."""

    stage = "toy"

    def __init__(self, rt: Runtime, log: list, extra: list[Callback]) -> None:
        super().__init__(rt)
        self.model = HybridLM(tiny_train_model(mtp=False)).to(rt.device)
        self.total_steps = rt.tc.max_steps
        self.log, self.extra = log, extra
        self.gen = torch.Generator().manual_seed(0)

    def batch(self) -> torch.Tensor:
        return torch.randint(0, 258, (2, 16), generator=self.gen)

    def prepare_step(self, step: int) -> Step:
        return Step([self.batch()], info={"drawn": step})

    def loss(self, micro: torch.Tensor, step: Step) -> Loss:
        logits = self.forward_model(micro).logits
        value = F.cross_entropy(logits[:, :-1].flatten(0, 1), micro[:, 1:].flatten())
        return Loss(value, {"ce": float(value.detach())})

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.log.append(("evaluate", 0))
        ids = torch.arange(32).view(2, 16) % 258
        logits = self.model(ids).logits
        return {
            "eval_loss": float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
        }

    def callbacks(self) -> list[Callback]:
        return [Throughput("sequences_per_s", 2), *self.extra]


def _trainer(tmp_path, log, extra, *, resume: bool = False, **train) -> Trainer:
    tc = TrainConfig(
        **{
            "max_steps": 4,
            "warmup_steps": 0,
            "log_interval": 2,
            "eval_interval": 2,
            "checkpoint_interval": 2,
            "out_dir": str(tmp_path / "run"),
            "progress": False,
            "plot": True,
            **train,
        }
    )
    build = lambda rt: RandomTokens(rt, log, extra)  # noqa: E731
    return Trainer(tc, build, resume=resume, overwrite=not resume)


def _rows(tmp_path, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def test_callbacks_run_at_their_points_in_order(tmp_path):
    log: list = []
    outputs: list = []
    extra = [
        DataRow(lambda: {"rows": 7}),
        StartRows(lambda: [{"kind": "reference", "step": 0, "x": 1.0}]),
        Recorder(log),
        Progress(keys=("loss",)),
        EndRows(lambda: [{"kind": "final", "step": 4}]),
        Export(lambda: outputs.append("export") or tmp_path / "hf"),
        Plot(lambda metrics: outputs.append("plot") or tmp_path / "toy.png"),
        Summary(lambda: {"figures": outputs[:]}),
    ]
    result = _trainer(tmp_path, log, extra).train()

    # a fresh run: the data row, the start rows, then the Trainer's evaluation at step 0
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert kinds[:3] == ["data", "reference", "eval"]
    assert kinds[-1] == "final"  # measured on the final model, after the last step
    assert log[:2] == [("on_start", 0), ("evaluate", 0)]
    # every step: the update's fields, then (after its row) evaluation and checkpoint
    steps = [e for e in log if e[0] in ("after_update", "on_step", "log_fields", "evaluate")]
    assert steps[1:] == [
        ("after_update", 1), ("on_step", 1),
        ("after_update", 2), ("log_fields", 2), ("on_step", 2), ("evaluate", 0),
        ("after_update", 3), ("on_step", 3),
        ("after_update", 4), ("log_fields", 2), ("on_step", 4), ("evaluate", 0),
    ]  # fmt: skip
    # the workers are released before the outputs of the finished run are written
    assert log[-2:] == [("close", 4), ("on_end", 1)]
    train = _rows(tmp_path, "train")
    assert [r["step"] for r in train] == [2, 4]
    assert all(r["recorded"] == 1.0 and r["window_steps"] == 2 for r in train)
    assert all(r["sequences_per_s"] > 0 and r["drawn"] == r["step"] - 1 for r in train)
    assert [r["step"] for r in _rows(tmp_path, "eval")] == [0, 2, 4]
    # export, then plot, then the summary that sees both
    assert result["hf"] == str(tmp_path / "hf") and result["plot"] == str(tmp_path / "toy.png")
    assert result["figures"] == ["export", "plot"] and result["data"] == {"rows": 7}
    assert result["checkpoint"].endswith("step_00000004")


def test_a_run_stopped_early_writes_no_outputs_and_a_resume_no_start_rows(tmp_path):
    log: list = []
    outputs: list = []
    extra = [
        StartRows(lambda: [{"kind": "reference", "step": 0}]),
        Recorder(log),
        Close(lambda: outputs.append("released")),
        EndRows(lambda: [{"kind": "final", "step": 4}]),
        Export(lambda: outputs.append("export") or tmp_path / "hf"),
        Summary(lambda: {"seen": len(outputs)}),
    ]
    result = _trainer(tmp_path, log, extra).train(until_step=2)
    assert log[-2:] == [("close", 2), ("on_end", 0)]
    assert outputs == ["released"] and result["hf"] is None and result["plot"] is None
    assert result["seen"] == 1  # result fields are still computed
    assert not _rows(tmp_path, "final")

    log.clear()
    result = _trainer(tmp_path, log, extra, resume=True).train()
    assert ("on_start", 2) not in log and log[0] == ("after_update", 3)
    assert [r["kind"] for r in _rows(tmp_path, "reference")] == ["reference"]  # once, at step 0
    assert outputs == ["released", "released", "export"] and result["hf"] == str(tmp_path / "hf")
    assert len(_rows(tmp_path, "final")) == 1


def test_after_update_fields_and_progress_text(tmp_path):
    calls: list = []
    extra = [
        AfterUpdate(
            lambda step, outcome: calls.append(outcome.finite) or {"synced": step.info["drawn"]}
        ),
        Progress(lambda row: f"custom {row['step']}"),
        Progress(keys=("loss",)),
    ]
    trainer = _trainer(tmp_path, [], extra, log_interval=1, checkpoint_interval=0)
    trainer.train()
    assert calls == [True] * 4
    assert [r["synced"] for r in _rows(tmp_path, "train")] == [0, 1, 2, 3]
    assert trainer._progress_text({"step": 3, "loss": 1.0}) == "custom 3"  # the first that has one
