"""Direct preference optimisation: `run_dpo(cfg)` and `hybridlm dpo`.

Shape legend: B pairs per micro-batch, L padded length, V vocabulary.

Data: preference pairs `{"prompt": messages | str, "chosen": completion, "rejected": completion}`
(a completion is a string, an assistant message or a list of messages that continue the prompt)
from JSONL / Parquet / a saved HF dataset, or built by delta learning (`build_delta_pairs`, Olmo
3 §7.2 / §8.2: chosen from a strong model, rejected from a weak one, only the chosen filtered).
Pairs whose completions differ by more than `data.max_len_gap` tokens (default 100, Olmo 3
Instruct DPO's length control) are dropped and counted.

Loss (`train.objectives.dpo_loss`): `dpo` (beta 0.1 by default) or length-normalised
`dpo_norm` (beta 5, Olmo 3 Instruct). The log-probs are the sum (or mean) over the completion's
assistant tokens; the reference model's log-probs are computed once before training and cached
on disk under `<ref_cache_dir>/ref_logps-<key>.pt`, the key hashing the tokenised pairs and the
reference weights, so a second run (an LR sweep) skips the reference forwards. The loss of an
optimizer step is the mean over its pairs (all micro-batches), so accumulation gives the
big-batch gradient.

Each batch stacks chosen and rejected sequences, right-padded, in one forward: the model is
causal, so padding after a sequence does not change its log-probs (no mask needed).

Metrics (`metrics.jsonl`, kind "train" / "eval"): loss, reward accuracy, reward margin, chosen
and rejected rewards (beta * (log pi - log ref)) and the chosen / rejected policy log-probs.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..data.chat import parse_assistant, render_with_spans, validate
from ..data.sft import ChatExample, Conversation, ReadReport, _raw_rows, encode_chat
from ..files import atomic_write
from ..io import load_model
from ..model.model import IGNORE_INDEX, HybridLM, ModelOutput
from .config import TrainConfig
from .objectives import dpo_loss, sequence_logps
from .parallel import is_main
from .post_training import (
    ChatSource,
    PostTrainingRunConfig,
    answer_matches,
    export_hf,
    generate_replies,
    load_source,
    moe_balancing,
    pad_id_of,
    progress_bar,
    prompt_and_answer,
    prompt_key,
)
from .trainer import (
    Loss,
    Runtime,
    Step,
    Trainer,
    TrainModule,
    check_tokenizer,
    initial_model,
    run_tokenizer,
)

DEFAULT_BETA = {"dpo": 0.1, "dpo_norm": 5.0}


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


# ---------------------------------------------------------------------------- batches + logps
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


def policy_logps(
    model: HybridLM, batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs [2B], completion token counts [2B])."""
    logits = model(batch["input_ids"].to(device)).logits
    return sequence_logps(logits, batch["labels"].to(device))


def _state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pairs_hash(pairs: Sequence[TokenizedPair]) -> str:
    h = hashlib.sha256()
    for p in pairs:
        for s in (p.chosen, p.rejected):
            h.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(s.loss_mask, dtype=np.bool_).tobytes())
            h.update(b"|")
    return h.hexdigest()


@torch.no_grad()
def reference_logps(
    ref_model: HybridLM,
    pairs: Sequence[TokenizedPair],
    *,
    cache_dir: str | Path | None,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Reference log-probs of every pair: (chosen [N], rejected [N], loaded from cache?).

    Cached at `<cache_dir>/ref_logps-<sha256(pairs, weights)[:24]>.pt`; `cache_dir=None`
    computes without caching."""
    key = hashlib.sha256((pairs_hash(pairs) + _state_hash(ref_model)).encode()).hexdigest()[:24]
    file = Path(cache_dir) / f"ref_logps-{key}.pt" if cache_dir is not None else None
    if file is not None and file.is_file():
        try:
            data = torch.load(file, weights_only=True)
            return data["chosen"], data["rejected"], True
        except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as err:
            # a cache is only a shortcut: a damaged one is computed again and replaced
            print(f"reference cache {file} is unreadable ({type(err).__name__}); recomputing")
    device = next(ref_model.parameters()).device
    was_training = ref_model.training
    ref_model.eval()
    chosen, rejected = [], []
    try:
        with progress_bar("reference log-probs", progress) as bar:
            task = bar.add_task("", total=len(pairs), info="")
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i : i + batch_size]
                lp, _ = policy_logps(ref_model, collate_pairs(chunk, pad_id), device)
                chosen.append(lp[: len(chunk)].double().cpu())
                rejected.append(lp[len(chunk) :].double().cpu())
                bar.update(task, advance=len(chunk))
    finally:
        ref_model.train(was_training)
    c, r = torch.cat(chosen), torch.cat(rejected)
    if file is not None:
        # every rank of a job computes the same cache; each writes through its own temporary
        atomic_write(file, lambda fh: torch.save({"chosen": c, "rejected": r}, fh))
    return c, r, False


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
class DPODataConfig:
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


@dataclass(kw_only=True)
class DPOConfig:
    """The DPO objective, reference and evaluation; the policy starts from `train.init_from`
    (usually the SFT model)."""

    ref_from: str = ""  # the reference model; "" = train.init_from
    loss: Literal["dpo", "dpo_norm"] = "dpo_norm"
    beta: float = 0.0  # 0: the default of the loss (dpo 0.1, dpo_norm 5)
    ref_cache_dir: str = ""  # "" = <out_dir>/ref_cache
    # held-out conversations with reference answers: exact match of greedy replies (the first
    # `eval_generate`; prompts that also occur in the pairs are removed)
    eval_source: ChatSource | None = None
    eval_generate: int = 64
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.loss not in DEFAULT_BETA:
            raise ValueError(f"dpo.loss must be 'dpo' or 'dpo_norm', got {self.loss!r}")
        if self.beta < 0:
            raise ValueError(f"dpo.beta must be >= 0 (0 = default), got {self.beta}")

    @property
    def effective_beta(self) -> float:
        return self.beta or DEFAULT_BETA[self.loss]


@dataclass(kw_only=True)
class DPORunConfig(PostTrainingRunConfig):
    """`data`, `train`, `dpo` sections; the model comes from `train.init_from`."""

    REQUIRED = ("data", "dpo")
    WHAT = "DPO run config"

    data: DPODataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: DPOConfig


# ---------------------------------------------------------------------------- the trainer
class PairwiseStage(TrainModule):
    """A stage trained on preference pairs (DPO; reward models, `train.rm`): the model from
    `train.init_from` (`initial_model`), the pairs (read from `data.path` or built by delta
    learning), tokenised, filtered and split into train / held-out, and their order (a
    permutation per epoch and a cursor, both checkpointed). Under data parallelism every rank
    draws the global micro-batch of world * batch_size pairs and trains on its consecutive
    part, the loss divided by the global pair count."""

    rate_key = "pairs_per_s"

    @property
    def units_per_step(self) -> int:
        return self.pairs_per_step

    def __init__(self, run: Any, rt: Runtime, data: DPODataConfig) -> None:
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

    def export(self) -> Path | None:
        return export_hf(self.model, self.out, self.tokenizer, self.stage)

    def summary(self) -> dict[str, Any]:
        return {"data": self.data_summary()}

    def data_summary(self) -> dict[str, Any]:
        return {
            "read": self.report.summary(),
            "dropped": dict(self.dropped),
            "train_pairs": len(self.train_pairs),
            "held_out_pairs": len(self.held_pairs),
        }


class DPO(PairwiseStage):
    """Policy, reference log-probs and pairs of one DPO run."""

    stage = "dpo"
    plot_train = ("loss", "reward_accuracy", "reward_margin")
    plot_eval = ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_accuracy")

    def progress_info(self, row: dict[str, Any]) -> str:
        return f"loss {row['loss']:.4f} acc {row['reward_accuracy']:.2f}"

    def __init__(self, run: DPORunConfig, rt: Runtime) -> None:
        super().__init__(run, rt, run.data)
        tc, dc, pc = run.train, run.data, run.dpo
        self.pc = pc
        self.beta = pc.effective_beta
        self.eval_convs: list[Conversation] = []
        if pc.eval_source is not None:
            seen = {prompt_key(p.prompt + p.chosen) for p in self.pairs}
            convs = load_source(pc.eval_source, ReadReport())
            clean = [c for c in convs if prompt_key(c) not in seen]
            self.dropped["eval prompts also in the pairs"] = len(convs) - len(clean)
            self.eval_convs = clean[: pc.eval_generate]

        # reference log-probs, once (cached on disk)
        ref = (
            self.model
            if not pc.ref_from or pc.ref_from == tc.init_from
            else self.generator_model(pc.ref_from, "dpo.ref_from").float()
        )
        cache = pc.ref_cache_dir or str(self.out / "ref_cache")
        all_pairs = self.train_pairs + self.held_pairs
        c, r, self.ref_cached = reference_logps(
            ref,
            all_pairs,
            cache_dir=cache,
            batch_size=dc.batch_size,
            pad_id=self.pad_id,
            progress=tc.progress,
        )
        n = len(self.train_pairs)
        self.ref_train = (c[:n], r[:n])
        self.ref_held = (c[n:], r[n:])
        del ref

    # ------------------------------------------------------------------ steps
    def _loss(
        self, idx: Sequence[int], pairs: Sequence[TokenizedPair], ref: tuple, denom: int
    ) -> tuple[torch.Tensor, dict[str, float], ModelOutput]:
        batch = collate_pairs([pairs[i] for i in idx], self.pad_id)
        model = self.forward_model if self.model.training else self.model
        with self.rt.autocast():
            out = model(batch["input_ids"].to(self.device))
            lp, n = sequence_logps(out.logits, batch["labels"].to(self.device))
        B = len(idx)
        sel = torch.tensor(idx)
        ref_c = ref[0][sel].to(self.device, lp.dtype)
        ref_r = ref[1][sel].to(self.device, lp.dtype)
        losses, m = dpo_loss(
            lp[:B],
            lp[B:],
            ref_c,
            ref_r,
            beta=self.beta,
            kind=self.pc.loss,
            chosen_tokens_B=n[:B],
            rejected_tokens_B=n[B:],
        )
        parts = {k: float(v.sum()) / denom for k, v in m.items()}
        parts["logp_chosen"] = float(lp[:B].detach().sum()) / denom
        parts["logp_rejected"] = float(lp[B:].detach().sum()) / denom
        return losses.sum() / denom, parts, out

    def loss(self, micro: list[int], step: Step) -> Loss:
        value, metrics, out = self._loss(
            micro, self.train_pairs, self.ref_train, self.pairs_per_step
        )
        # the routers keep their balancing loss in every stage that trains them (§2.1.1)
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    def held_out_loss(self, idx: list[int], denom: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss, parts, _ = self._loss(idx, self.held_pairs, self.ref_held, denom)
        return loss, parts

    def generation_eval(self) -> dict[str, float]:
        """Exact match of greedy replies on `dpo.eval_source`'s held-out questions."""
        if not self.eval_convs:
            return {}
        pa = [prompt_and_answer(c) for c in self.eval_convs]
        replies = generate_replies(
            self.model,
            self.tokenizer,
            [p for p, _ in pa],
            max_new_tokens=self.pc.max_new_tokens,
        )
        hits = sum(answer_matches(r, a) for r, (_, a) in zip(replies, pa, strict=True))
        return {"eval_accuracy": hits / len(pa)}

    def data_summary(self) -> dict[str, Any]:
        return {
            **super().data_summary(),
            "ref_logps_from_cache": self.ref_cached,
            "beta": self.beta,
            "loss": self.pc.loss,
        }


def dpo_trainer(cfg: DPORunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of a DPO run, ready to `train()`."""
    return Trainer(cfg.train, lambda rt: DPO(cfg, rt), resume=resume, overwrite=overwrite)


def run_dpo(
    cfg: DPORunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run DPO from a config; returns final metrics, checkpoint and plot paths. `resume` /
    `overwrite`: continue or replace an earlier run in `train.out_dir` (as `run_sft`)."""
    trainer = dpo_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
