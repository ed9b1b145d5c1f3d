"""Preference pairs: reading, building by delta learning or verification, tokenising, filtering,
batching, and the pairwise TrainModule that DPO (`train.stages.dpo`) and reward-model training
(`train.stages.rm`) share.

Shape legend: B pairs per micro-batch, L padded length.

Data: preference pairs `{"prompt": messages | str, "chosen": completion, "rejected": completion}`
(a completion is a string, an assistant message or a list of messages that continue the prompt)
from JSONL / Parquet / a saved HF dataset, or built by delta learning (`build_delta_pairs`, Olmo
3 §7.2 / §8.2: chosen from a strong model, rejected from a weak one, only the chosen filtered)
or from one model's samples labelled by a verifier (`build_verified_pairs`). Pairs whose
completions differ by more than `data.max_len_gap` tokens (default 100, Olmo 3 Instruct DPO's
length control) are dropped and counted.

`PairDataConfig` is the `data` section of both stages' run configs; `PairwiseModule` loads the
model and the pairs, splits off the held-out pairs and orders the rest; the stages add the loss.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..data.chat import parse_assistant, render_with_spans, validate
from ..data.sft import ChatExample, Conversation, ReadReport, _raw_rows, encode_chat
from ..io import load_model
from ..model.model import IGNORE_INDEX, HybridLM
from .callbacks import Callback, DataRow, Export, Progress, Throughput, curves
from .post_training import (
    ChatSource,
    answer_matches,
    export_hf,
    generate_replies,
    load_source,
    pad_id_of,
    prompt_and_answer,
)
from .trainer import (
    Runtime,
    Step,
    TrainModule,
    check_tokenizer,
    initial_model,
    run_tokenizer,
)


# ---------------------------------------------------------------------------- pairs
@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two completions (lists of messages continuing the prompt)."""

    prompt: Conversation
    chosen: Conversation
    rejected: Conversation


@dataclass(frozen=True)
class TokenizedPair:
    chosen: ChatExample
    rejected: ChatExample

    @property
    def length_gap(self) -> int:
        return abs(self.chosen.num_loss_tokens - self.rejected.num_loss_tokens)


def _completion(value: Any, where: str) -> Conversation:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, Sequence):
        return [dict(m) for m in value]
    raise ValueError(f"{where} must be a string, a message or a list of messages")


def pair_from_row(row: Any) -> PreferencePair:
    """A `PreferencePair` from `{"prompt", "chosen", "rejected"}` (ValueError if unusable)."""
    if not isinstance(row, Mapping) or not all(k in row for k in ("prompt", "chosen", "rejected")):
        raise ValueError("a preference row needs 'prompt', 'chosen' and 'rejected'")
    prompt = row["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    pair = PreferencePair(
        prompt=[dict(m) for m in prompt],
        chosen=_completion(row["chosen"], "chosen"),
        rejected=_completion(row["rejected"], "rejected"),
    )
    for side in (pair.chosen, pair.rejected):
        turns = validate([*pair.prompt, *side])
        if not turns[-1].is_assistant:
            raise ValueError("a completion must end with an assistant message")
    return pair


def read_pairs(
    path: str | Path,
    *,
    kind: Literal["auto", "jsonl", "parquet", "hf"] = "auto",
    split: str = "train",
    max_rows: int | None = None,
    report: ReadReport | None = None,
) -> list[PreferencePair]:
    """Preference pairs from JSONL / Parquet / HF; bad rows counted in `report`."""
    report = report if report is not None else ReadReport()
    out = []
    for k, (row, reason) in enumerate(_raw_rows(str(path), kind, split)):
        if max_rows is not None and len(out) >= max_rows:
            break
        report.rows += 1
        if reason:
            report.skip(reason, k)
            continue
        if isinstance(row, Mapping):
            row = {key: v for key, v in row.items() if v is not None}
        try:
            out.append(pair_from_row(row))
        except ValueError as err:
            report.skip("invalid preference row", k, str(err))
            continue
        report.kept += 1
    return out


def tokenize_pair(pair: PreferencePair, tokenizer: Any) -> TokenizedPair:
    """Both sides encoded with loss only on the completion's assistant turns."""
    prompt_chars = len(render_with_spans(pair.prompt)[0])
    return TokenizedPair(
        chosen=encode_chat([*pair.prompt, *pair.chosen], tokenizer, loss_from_char=prompt_chars),
        rejected=encode_chat(
            [*pair.prompt, *pair.rejected], tokenizer, loss_from_char=prompt_chars
        ),
    )


def filter_pairs(
    pairs: Sequence[TokenizedPair], *, max_len: int, max_len_gap: int
) -> tuple[list[int], Counter]:
    """Indices of the pairs kept; dropped ones counted by reason. `max_len_gap` < 0: no gap
    filter (Olmo 3 Instruct DPO keeps |len(chosen) - len(rejected)| <= 100 tokens)."""
    keep, dropped = [], Counter()
    for i, p in enumerate(pairs):
        if max(len(p.chosen), len(p.rejected)) > max_len:
            dropped[f"longer than {max_len} tokens"] += 1
        elif p.chosen.num_loss_tokens == 0 or p.rejected.num_loss_tokens == 0:
            dropped["empty completion"] += 1
        elif max_len_gap >= 0 and p.length_gap > max_len_gap:
            dropped[f"length gap > {max_len_gap} tokens"] += 1
        elif p.chosen.input_ids == p.rejected.input_ids:
            dropped["chosen == rejected"] += 1
        else:
            keep.append(i)
    return keep, dropped


# ---------------------------------------------------------------------------- delta learning
Generator = Callable[[Sequence[Conversation]], list[str]]


def model_generator(
    model: HybridLM, tokenizer: Any, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> Generator:
    """A generation function (prompts -> assistant reply texts) backed by `model`."""

    def gen(prompts: Sequence[Conversation]) -> list[str]:
        return generate_replies(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        )

    return gen


def build_delta_pairs(
    prompts: Sequence[Conversation],
    strong: Generator,
    weak: Generator,
    tokenizer: Any,
    *,
    max_len_gap: int = 100,
    keep_chosen: Callable[[Conversation, str], bool] | None = None,
) -> tuple[list[PreferencePair], Counter]:
    """Delta-learning pairs (Olmo 3 §7.2): chosen = the strong generator's reply, rejected = the
    weak one's. Only the chosen side is filtered (`keep_chosen(prompt, reply)`); a wrong
    rejected reply is useful contrast. Identical replies and length gaps over `max_len_gap`
    tokens (the assistant turn's tokens) are dropped. Returns the pairs and drop counts."""
    chosen_txt, rejected_txt = strong(prompts), weak(prompts)
    if len(chosen_txt) != len(prompts) or len(rejected_txt) != len(prompts):
        raise ValueError("a generator must return one reply per prompt")
    pairs, dropped = [], Counter()
    for prompt, c, r in zip(prompts, chosen_txt, rejected_txt, strict=True):
        if keep_chosen is not None and not keep_chosen(prompt, c):
            dropped["chosen filtered"] += 1
            continue
        if c == r:
            dropped["chosen == rejected"] += 1
            continue
        pair = PreferencePair(
            prompt=list(prompt), chosen=[parse_assistant(c)], rejected=[parse_assistant(r)]
        )
        tok = tokenize_pair(pair, tokenizer)
        if max_len_gap >= 0 and tok.length_gap > max_len_gap:
            dropped[f"length gap > {max_len_gap} tokens"] += 1
            continue
        pairs.append(pair)
    return pairs, dropped


def build_verified_pairs(
    prompts: Sequence[Conversation],
    answers: Sequence[str],
    sample: Generator,
    *,
    samples_per_prompt: int,
) -> tuple[list[PreferencePair], Counter]:
    """Pairs labelled by a verifier on one model's own samples: `samples_per_prompt` replies per
    prompt (`sample`, e.g. T = 1); chosen = the first reply whose answer matches the reference
    (`answer_matches`), rejected = the first that does not. Prompts whose replies are all right
    or all wrong give no pair and are counted."""
    if samples_per_prompt < 2:
        raise ValueError(f"samples_per_prompt must be >= 2, got {samples_per_prompt}")
    if len(answers) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    k = samples_per_prompt
    replies = sample([p for p in prompts for _ in range(k)])
    if len(replies) != len(prompts) * k:
        raise ValueError("the sampler must return one reply per prompt it is given")
    pairs, dropped = [], Counter()
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        group = replies[i * k : (i + 1) * k]
        good = [r for r in group if answer_matches(r, answer)]
        bad = [r for r in group if not answer_matches(r, answer)]
        if not good or not bad:
            dropped["every sample right" if good else "every sample wrong"] += 1
            continue
        pairs.append(
            PreferencePair(
                prompt=list(prompt),
                chosen=[parse_assistant(good[0])],
                rejected=[parse_assistant(bad[0])],
            )
        )
    return pairs, dropped


def _key(conv: Conversation) -> str:
    return json.dumps(conv, sort_keys=True, ensure_ascii=False)


def write_pairs(pairs: Sequence[PreferencePair], path: str | Path) -> Path:
    """Pairs as JSONL in the format `read_pairs` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in pairs:
            row = {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------------------- batches
def collate_pairs(pairs: Sequence[TokenizedPair], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """input_ids / labels [2B, L]: chosen rows 0..B-1, rejected rows B..2B-1, right-padded."""
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    L = max(len(s) for s in seqs)
    ids_BL = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    labels_BL = torch.full((len(seqs), L), IGNORE_INDEX, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids = torch.tensor(s.input_ids)
        ids_BL[b, : len(s)] = ids
        labels_BL[b, : len(s)] = torch.where(torch.tensor(s.loss_mask), ids, IGNORE_INDEX)
    return {"input_ids": ids_BL, "labels": labels_BL}


# ---------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class DeltaConfig:
    """Build pairs by delta learning: prompts from `prompts` (everything before each
    conversation's last assistant turn), chosen from the `strong` checkpoint, rejected from
    the `weak` one (greedy unless `temperature` > 0). `save_to`: also write them as JSONL."""

    strong: str
    weak: str
    prompts: ChatSource
    max_new_tokens: int = 128
    temperature: float = 0.0
    # exact_answer: keep a pair only if the chosen reply's content equals the source
    # conversation's last assistant content (a verifier on the chosen side only)
    filter_chosen: Literal["none", "exact_answer"] = "none"
    save_to: str = ""


@dataclass(kw_only=True)
class VerifiedConfig:
    """Build pairs from one model's samples, labelled by exact match with the reference answers
    of `prompts` (`build_verified_pairs`): the reward model learns what the verifier knows, on
    the policy's own distribution. `save_to`: also write them as JSONL."""

    model: str
    prompts: ChatSource
    samples_per_prompt: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    save_to: str = ""


@dataclass(kw_only=True)
class PairDataConfig:
    path: str = ""  # preference pairs (JSONL / Parquet / HF dataset); or `delta` / `verified`
    kind: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    split: str = "train"
    max_rows: int = 0
    delta: DeltaConfig | None = None
    verified: VerifiedConfig | None = None
    tokenizer: str = ""  # "": the tokenizer of train.init_from (trainer.run_tokenizer)
    max_len: int = 512
    max_len_gap: int = 100  # Olmo 3 Instruct DPO length control; < 0 disables
    batch_size: int = 8  # pairs per micro-batch
    held_out: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if bool(self.path) + (self.delta is not None) + (self.verified is not None) != 1:
            raise ValueError(
                "give exactly one of data.path (pairs), data.delta and data.verified (build them)"
            )
        if self.max_len < 2 or self.batch_size < 1 or self.held_out < 0:
            raise ValueError("data.max_len >= 2, data.batch_size >= 1, data.held_out >= 0")


# ---------------------------------------------------------------------------- the TrainModule
class PairwiseModule(TrainModule):
    """What the stages trained on preference pairs share (DPO, `train.stages.dpo.DPO`; reward
    models, `train.stages.rm.RewardModelTraining`): the model from `train.init_from`
    (`initial_model`), the pairs (read from `data.path` or built by delta learning or verification),
    tokenised, filtered and split into train / held-out, and their order (a permutation per epoch
    and a cursor, both checkpointed). Under data parallelism every rank draws the global micro-batch
    of world * batch_size pairs and trains on its consecutive part, the loss divided by the global
    pair count. A stage adds its `stage` name and its loss (`loss`, `held_out_loss`)."""

    plot_train: tuple[str, ...] = ("loss",)  # the PNG's train-row keys
    plot_eval: tuple[str, ...] | None = None  # eval-row keys (None: every one)
    progress_keys: tuple[str, ...] = ("loss",)  # the progress bar's train-row keys

    def __init__(self, run: Any, rt: Runtime, data: PairDataConfig) -> None:
        super().__init__(rt)
        self.run = run
        tc, dc = run.train, data
        self.tc, self.dc = tc, dc
        self.device, self.out = rt.device, rt.out
        if not tc.init_from:
            raise ValueError(
                f"{self.stage} needs train.init_from: the model to start from (the SFT model)"
            )
        self.tokenizer = run_tokenizer(dc, tc)
        self.pad_id = pad_id_of(self.tokenizer)
        self.model = self.initial_model()
        check_tokenizer(self.tokenizer, self.model, "train.init_from")
        self.report = ReadReport()
        self.dropped: Counter = Counter()

        self.pairs = self._pairs()
        tokenized = [tokenize_pair(p, self.tokenizer) for p in self.pairs]
        keep, dropped = filter_pairs(tokenized, max_len=dc.max_len, max_len_gap=dc.max_len_gap)
        self.dropped.update(dropped)
        if len(keep) <= dc.held_out:
            raise ValueError(
                f"{len(keep)} usable pairs, not more than data.held_out={dc.held_out} "
                f"(dropped: {dict(self.dropped)}; read: {self.report.summary()})"
            )
        order = np.random.default_rng([dc.seed, 6]).permutation(len(keep))
        held_idx = sorted(keep[i] for i in order[: dc.held_out])
        train_idx = [keep[i] for i in sorted(order[dc.held_out :])]
        self.train_pairs = [tokenized[i] for i in train_idx]
        self.held_pairs = [tokenized[i] for i in held_idx]
        self.pairs_per_step = dc.batch_size * rt.world_size * tc.grad_accum
        self.total_steps = tc.num_steps(self.pairs_per_step)
        self.cursor, self.epoch = 0, 0

    def initial_model(self) -> HybridLM:
        """The model trained, from `train.init_from`."""
        return initial_model(self.tc, None, self.device)

    def generator_model(self, path: str, setting: str) -> HybridLM:
        """A model beside the trained one (a generator of pairs, the reference; `setting` names
        the option it came from), which must share the run's tokenizer."""
        model = load_model(path, setting=setting).to(self.device)
        check_tokenizer(self.tokenizer, model, setting, path)
        return model

    def _pairs(self) -> list[PreferencePair]:
        dc = self.dc
        if dc.path:
            return read_pairs(
                dc.path,
                kind=dc.kind,
                split=dc.split,
                max_rows=dc.max_rows or None,
                report=self.report,
            )
        if dc.verified is not None:
            v = dc.verified
            pa = [prompt_and_answer(c) for c in load_source(v.prompts, self.report)]
            model = self.generator_model(v.model, "data.verified.model")
            sample = model_generator(
                model,
                self.tokenizer,
                max_new_tokens=v.max_new_tokens,
                temperature=v.temperature,
                seed=v.seed,
            )
            pairs, dropped = build_verified_pairs(
                [p for p, _ in pa],
                [a for _, a in pa],
                sample,
                samples_per_prompt=v.samples_per_prompt,
            )
            self.dropped.update(dropped)
            if v.save_to:
                write_pairs(pairs, v.save_to)
            return pairs
        delta = dc.delta
        assert delta is not None
        convs = load_source(delta.prompts, self.report)
        pa = [prompt_and_answer(c) for c in convs]
        prompts = [p for p, _ in pa]
        answers = {_key(p): a for p, a in pa}
        kw = {"max_new_tokens": delta.max_new_tokens, "temperature": delta.temperature}
        strong = self.generator_model(delta.strong, "data.delta.strong")
        weak = self.generator_model(delta.weak, "data.delta.weak")
        keep = None
        if delta.filter_chosen == "exact_answer":

            def keep(prompt: Conversation, reply: str) -> bool:
                return answer_matches(reply, answers[_key(prompt)])

        pairs, dropped = build_delta_pairs(
            prompts,
            model_generator(strong, self.tokenizer, **kw),
            model_generator(weak, self.tokenizer, **kw),
            self.tokenizer,
            max_len_gap=-1,  # the gap filter runs once, on every pair, in filter_pairs
            keep_chosen=keep,
        )
        self.dropped.update(dropped)
        if delta.save_to:
            write_pairs(pairs, delta.save_to)
        return pairs

    # ------------------------------------------------------------------ data order
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.dc.seed, 7, epoch]).permutation(len(self.train_pairs))

    def _next_indices(self) -> list[int]:
        """The next global micro-batch of pair indices (world * batch_size)."""
        out = []
        while len(out) < self.dc.batch_size * self.rt.world_size:
            order = self._epoch_order(self.epoch)
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            out.append(int(order[self.cursor]))
            self.cursor += 1
        return out

    def prepare_step(self, step: int) -> Step:
        b, r = self.dc.batch_size, self.rt.rank
        micro = [self._next_indices()[r * b : (r + 1) * b] for _ in range(self.tc.grad_accum)]
        return Step(micro)

    # ------------------------------------------------------------------ evaluation
    def held_out_loss(self, idx: list[int], denom: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss and metric sums of held-out pairs `idx`, divided by `denom`."""
        raise NotImplementedError

    def generation_eval(self) -> dict[str, float]:
        """Metrics of generated replies, when the stage has them."""
        return {}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The held-out pairs' mean loss and metrics (`eval_*`), then `generation_eval`."""
        if not self.held_pairs:
            return {}
        self.model.eval()
        try:
            n, bs = len(self.held_pairs), self.dc.batch_size
            total, parts = 0.0, Counter()
            for i in range(0, n, bs):
                loss, p = self.held_out_loss(list(range(i, min(n, i + bs))), n)
                total += float(loss)
                parts.update(p)
            row = {"eval_loss": total, **{f"eval_{k}": v for k, v in parts.items()}}
            row.update(self.generation_eval())
        finally:
            self.model.train()
        return row

    def run_config(self) -> dict[str, Any]:
        return {**self.run.to_dict(), "model": self.model.config.to_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "epoch": self.epoch, "tokens_seen": 0}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.cursor, self.epoch = meta["cursor"], meta["epoch"]

    def callbacks(self) -> list[Callback]:
        return [
            DataRow(self.data_summary),
            Throughput("pairs_per_s", self.pairs_per_step),
            Progress(keys=self.progress_keys),
            Export(lambda: export_hf(self.model, self.out, self.tokenizer, self.stage)),
            curves(self.out, self.stage, self.plot_train, self.plot_eval),
        ]

    def data_summary(self) -> dict[str, Any]:
        return {
            "read": self.report.summary(),
            "dropped": dict(self.dropped),
            "train_pairs": len(self.train_pairs),
            "held_out_pairs": len(self.held_pairs),
        }
