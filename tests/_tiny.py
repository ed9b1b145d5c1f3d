"""Tiny model and run configurations shared by the training tests, and a forced-token policy
double for the engine tests."""

from pathlib import Path

import torch

from hybridlm.config import ModelConfig
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.presets import get_preset
from hybridlm.train.config import RunConfig, TrainConfig


def tiny_train_model(*, mtp: bool = True) -> ModelConfig:
    """tiny-super shrunk to d_model 64 and pattern `ME*` (Mamba, LatentMoE, attention): a
    training step takes milliseconds on one core."""
    m = get_preset("tiny-super")
    m.vocab_size, m.d_model, m.pattern = 258, 64, "ME*"
    m.mamba.num_heads, m.mamba.head_dim, m.mamba.state_size, m.mamba.chunk_size = 4, 32, 16, 16
    m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim = 4, 2, 16
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 32
    m.moe.latent_size, m.moe.shared_expert_hidden = 32, 64
    if not mtp:
        m.mtp.pattern = ""
    m.validate()
    return m


def tiny_run(
    tmp: Path, out: str, *, docs: int = 40, seq_len: int = 32, batch_size: int = 2, **train
) -> RunConfig:
    """A pretraining run of `tiny_train_model` on `docs` small text files written under `tmp`
    (shared by the runs of one test), output in `tmp/out`; `train` overrides TrainConfig."""
    txt = tmp / f"txt{docs}"
    if not txt.is_dir():
        txt.mkdir()
        for i in range(docs):
            body = f"Story {i}. " + "Once upon a time a fox met a crow. " * (i % 7 + 1)
            (txt / f"{i:02d}.txt").write_text(body)
    data = DataConfig(
        sources=[SourceConfig(name="t", kind="text", path=str(txt))],
        shards_dir=str(tmp / f"shards{docs}"),
        seq_len=seq_len,
        batch_size=batch_size,
        eval_fraction=0.1,
        num_workers=0,
    )
    base = dict(
        max_steps=8,
        warmup_steps=2,
        log_interval=1,
        eval_interval=4,
        checkpoint_interval=3,
        out_dir=str(tmp / out),
        peak_flops=1e11,
        progress=False,
        plot=False,
    )
    return RunConfig(model=tiny_train_model(), data=data, train=TrainConfig(**{**base, **train}))


def reference_greedy(model, prompt, n, *, rep=1.0, freq=0.0, pres=0.0, bias=None) -> list[int]:
    """Greedy decoding with logit_bias and the penalties applied by hand, one full forward per
    token (vLLM's order: bias, then repetition over prompt + generated, then frequency /
    presence over the generated tokens): the reference the engine's batched processors match."""
    import torch

    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for tid, b in (bias or {}).items():
            logits[tid] += b
        for j in set(prompt + out):
            logits[j] = logits[j] / rep if logits[j] > 0 else logits[j] * rep
        for j in set(out):
            logits[j] -= out.count(j) * freq + pres
        out.append(int(logits.argmax()))
    return out


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """DPO pairs on one-digit arithmetic chats. Chosen: the answer; rejected: a refusal (a
    preference a tiny model learns quickly)."""
    from hybridlm.data.sft import arithmetic_conversations

    return [
        {
            "prompt": conv[:-1],
            "chosen": {"role": "assistant", "content": conv[-1]["content"]},
            "rejected": {"role": "assistant", "content": "I do not know."},
        }
        for conv in arithmetic_conversations(n, seed=seed, digits=1)
    ]


def lowercase_first_env(n: int = 64, name: str = "lower"):
    """An RL environment rewarding a reply that starts with a lowercase ASCII letter: a random
    byte model does so ~10% of the time, so most groups of 8 have reward variance."""
    from hybridlm.rl.environments import DatasetEnvironment, Problem
    from hybridlm.rl.verifiers import Reward

    class LowercaseFirst(DatasetEnvironment):
        def score(self, problem: Problem, completion: str) -> Reward:
            ok = completion[:1].isascii() and completion[:1].islower()
            return Reward(float(ok), "lowercase first" if ok else "other")

    problems = [
        Problem(id=f"{name}/{i}", messages=({"role": "user", "content": f"Say {i}."},), answer="")
        for i in range(n)
    ]
    return LowercaseFirst(problems, name=name)


class ForcedTokens:
    """A structured-output constraint (`infer.sampling.TokenConstraint`) that forces `ids`
    token by token, then allows anything (`then_free`) or ends the request: a scripted policy,
    since random models never open a reasoning block or call a tool."""

    def __init__(self, ids: list[int], vocab_size: int, *, then_free: bool = False) -> None:
        self.ids, self.vocab_size, self.then_free, self.n = list(ids), vocab_size, then_free, 0

    def allowed(self) -> torch.Tensor | None:
        if self.n >= len(self.ids):
            return None
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids[self.n]] = True
        return mask

    def accept(self, token: int) -> None:
        self.n += 1

    def finished(self) -> bool:
        return not self.then_free and self.n >= len(self.ids)


def sectioned(cls, **keys):
    """A run config of `cls` (RLRunConfig, MTPBoostRunConfig) from its sections' keys given
    side by side (`steps=2, lr=1e-3, reward="random"`): each goes to the section `cls.MOVED`
    names (the shape those configs had before they had sections), the train section's other
    keys (`out_dir`, `min_lr`, ...) under their own names."""
    import typing

    sections: dict[str, dict] = {}
    for key, value in keys.items():
        section, _, name = cls.MOVED.get(key, f"train.{key}").partition(".")
        sections.setdefault(section, {})[name] = value
    hints = typing.get_type_hints(cls)
    return cls(**{section: hints[section](**kw) for section, kw in sections.items()})


def rl_run(**keys):
    """An `RLRunConfig` from its sections' keys side by side (`sectioned`)."""
    from hybridlm.rl.learner import RLRunConfig

    return sectioned(RLRunConfig, **keys)


def boost_run(**keys):
    """An `MTPBoostRunConfig` from its sections' keys side by side (`sectioned`)."""
    from hybridlm.train.mtp_boost import MTPBoostRunConfig

    return sectioned(MTPBoostRunConfig, **keys)


def tool_rl_config(checkpoint: str, out, **kw):
    """A two-step GRPO run on calculator episodes (2-digit products, 3 turns) for the
    `tool_policy` fixture; random rewards, so groups vary whatever the tiny policy answers."""
    from hybridlm.rl.env_config import EnvConfig

    base = dict(
        checkpoint=checkpoint,
        out_dir=str(out),
        envs=[EnvConfig(kind="calculator", digits=2, num_problems=200, seed=1, max_turns=3)],
        eval_envs=[EnvConfig(kind="calculator", digits=2, num_problems=200, seed=2, max_turns=3)],
        eval_problems=4,
        eval_interval=2,
        reward="random",
        steps=2,
        groups_per_step=2,
        group_size=4,
        max_draws=6,
        max_new_tokens=100,
        max_episode_tokens=220,
        temperature=0.5,
        lr=1e-3,
        executor="inline",
        micro_batch_size=4,
    )
    return rl_run(**{**base, **kw})


def tiny_sft_run(tmp: Path, out: str = "sft", *, steps: int = 1) -> Path:
    """A finished SFT run of `tiny_train_model` on generated arithmetic chats in `tmp/out`:
    run.yaml, checkpoints/step_*, hf/ (what `hybridlm speedrun` leaves in runs/speedrun/sft)."""
    from hybridlm.train.post_training import ChatSource, SFTDataConfig
    from hybridlm.train.stages.sft import SFTConfig, SFTRunConfig, run_sft

    run_sft(
        SFTRunConfig(
            model=tiny_train_model(),
            data=SFTDataConfig(
                sources=[ChatSource(kind="arithmetic", max_rows=80, digits=1, seed=3)],
                seq_len=128,
                batch_size=2,
                held_out=4,
            ),
            train=TrainConfig(
                max_steps=steps,
                warmup_steps=0,
                eval_interval=0,
                log_interval=1,
                out_dir=str(tmp / out),
                progress=False,
                plot=False,
            ),
            sft=SFTConfig(eval_generate=0),
        )
    )
    return tmp / out
