"""Reward models: the score head reads each sequence's last token (padding changes nothing), the
Bradley-Terry loss on hand values, a tiny run that ranks held-out pairs, exact resume, verifier-
labelled pairs, and GRPO rewarded by the trained model (RLHF) with the verifier still logged."""

import json
import math

import pytest
import torch

from _tiny import arithmetic_pairs, lowercase_first_env, rl_run, tiny_train_model
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.model import build_model
from hybridlm.rl.environments import MixtureEnvironment
from hybridlm.rl.learner import run_rl
from hybridlm.train.config import TrainConfig
from hybridlm.train.objectives import bradley_terry_loss
from hybridlm.train.pairs import PairDataConfig, build_verified_pairs
from hybridlm.train.reward_model import RewardModelScorer, sequence_rewards, with_score_head
from hybridlm.train.stages.rm import RMConfig, RMRunConfig, run_rm

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


def _init(tmp_path):
    init = tmp_path / "init"
    if not (init / "checkpoints").exists():
        model = build_model(tiny_train_model(), seed=0, device=torch.device("cpu"))
        meta = {"run_config": {"model": model.config.to_dict()}}
        save_checkpoint(init, step=0, model=model, optimizer=None, meta=meta)
    return init


def _rm_run(tmp_path, out, *, steps, **rm) -> RMRunConfig:
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(48, seed=2)))
    return RMRunConfig(
        data=PairDataConfig(path=str(path), max_len=256, batch_size=4, held_out=16),
        train=TrainConfig(
            lr=3e-3,
            warmup_steps=1,
            schedule="constant",
            weight_decay=0.0,
            max_steps=steps,
            eval_interval=steps,
            log_interval=1,
            checkpoint_interval=3,
            out_dir=str(tmp_path / out),
            init_from=str(_init(tmp_path) / "checkpoints" / "step_00000000"),
            progress=False,
            plot=False,
        ),
        rm=RMConfig(**rm),
    )


def test_score_head_reads_the_last_token_whatever_the_padding():
    model = with_score_head(build_model(tiny_train_model(), seed=0, device=torch.device("cpu")))
    assert model.config.num_labels == 1 and model.score.weight.shape == (1, 64)
    rows = [TOK.encode("a short one"), TOK.encode("a somewhat longer sequence here")]
    ids = torch.zeros(2, max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    with torch.no_grad():
        r, _ = sequence_rewards(model.eval(), ids, torch.tensor([len(x) for x in rows]))
        alone = [
            sequence_rewards(model, torch.tensor([x]), torch.tensor([len(x)]))[0] for x in rows
        ]
    torch.testing.assert_close(r, torch.cat(alone), atol=1e-5, rtol=0)
    assert with_score_head(model) is model  # already a reward model


def test_bradley_terry_loss_on_hand_values():
    rc, rr = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss, m = bradley_terry_loss(rc, rr)
    want = [math.log1p(math.exp(-d)) for d in (2.0, 0.0, -2.0)]
    torch.testing.assert_close(loss, torch.tensor(want))
    assert m["accuracy"].tolist() == [1.0, 0.0, 0.0] and m["margin"].tolist() == [2.0, 0.0, -2.0]
    centred, _ = bradley_terry_loss(rc, rr, center_coef=0.5)
    torch.testing.assert_close(centred - loss, 0.5 * (rc + rr) ** 2)


def test_tiny_reward_model_ranks_held_out_pairs_and_resumes(tmp_path):
    res = run_rm(_rm_run(tmp_path, "rm", steps=12))
    rows = [json.loads(x) for x in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert first["eval_loss"] == pytest.approx(math.log(2), abs=0.05)  # a fresh head: ~chance
    assert last["eval_accuracy"] >= 0.9 and last["eval_loss"] < 0.3, last
    assert res["data"]["held_out_pairs"] == 16
    # the run directory is the reward model: it scores the chosen above the rejected
    scorer = RewardModelScorer(tmp_path / "rm")
    pair = arithmetic_pairs(200, seed=9)[-1]
    seqs = [
        TOK.encode("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs))
        for msgs in ([*pair["prompt"], pair["chosen"]], [*pair["prompt"], pair["rejected"]])
    ]
    good, bad = scorer.score(seqs)
    assert good > bad
    # exact resume
    part = _rm_run(tmp_path, "part", steps=6)
    run_rm(part, until_step=3)
    run_rm(part, resume=True)
    full = _rm_run(tmp_path, "full", steps=6)
    run_rm(full)

    def losses(out):
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines if json.loads(x)["kind"] == "train"]

    assert losses("part") == losses("full") and len(losses("full")) == 6


def test_verified_pairs_take_a_right_and_a_wrong_sample():
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    answers = ["1", "2", "3"]

    def sample(batch):
        assert len(batch) == 6
        return ["1", "x", "2", "2", "y", "z"]

    pairs, dropped = build_verified_pairs(prompts, answers, sample, samples_per_prompt=2)
    assert len(pairs) == 1 and pairs[0].chosen[0]["content"] == "1"
    assert pairs[0].rejected[0]["content"] == "x"
    assert dropped == {"every sample right": 1, "every sample wrong": 1}
    with pytest.raises(ValueError, match="samples_per_prompt"):
        build_verified_pairs(prompts, answers, sample, samples_per_prompt=1)


def test_rlhf_rewards_rollouts_with_the_reward_model(tmp_path):
    run_rm(_rm_run(tmp_path, "rm", steps=3))
    env, held = lowercase_first_env(), lowercase_first_env(name="held")
    cfg = rl_run(
        checkpoint=str(_init(tmp_path)),
        out_dir=str(tmp_path / "rlhf"),
        reward="rm",
        reward_model=str(tmp_path / "rm"),
        length_penalty=0.1,
        steps=2,
        groups_per_step=2,
        group_size=4,
        max_draws=4,
        max_new_tokens=6,
        eval_problems=4,
        executor="inline",
        micro_batch_size=8,
    )
    res = run_rl(cfg, env=MixtureEnvironment([env]), eval_env=MixtureEnvironment([held]))
    train = res["train"]
    assert len(train) == 2 and all(r["groups_kept"] == 2 for r in train)  # real-valued rewards
    assert all("batch/all/reward_mean" in r for r in train)  # the verifier, logged alongside
    drawn = [r for r in train if r["groups_drawn"]]  # a step may train on groups drawn before
    assert drawn and all(r["reward_mean"] != r["batch/all/reward_mean"] for r in drawn), train
    with pytest.raises(ValueError, match="reward_model"):
        rl_run(checkpoint="x", reward="rm").validate()
