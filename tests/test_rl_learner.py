"""The GRPO learner: trainer log-probs equal the engine's, a verifiable preference is learned
(inline executor), and the asynchronous loop runs across processes on a local Ray cluster with
the policy lag bounded."""

from __future__ import annotations

import json

import pytest
import torch

from _tiny import lowercase_first_env, rl_run
from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.rollout import RolloutPool, RolloutRequest
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load_model
from hybridlm.presets import get_preset
from hybridlm.rl.environments import MixtureEnvironment
from hybridlm.rl.learner import RLRunConfig, completion_logprobs, run_rl


def _checkpoint(tmp_path, seed: int = 0) -> str:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern, cfg.mtp.pattern = 258, 64, "M*E", ""
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.chunk_size = 2, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 2, 1, 32
    cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 64
    path = tmp_path / "policy"
    save_pretrained(HybridLM(cfg, seed=seed), path)
    return str(path)


def test_trainer_logprobs_equal_the_engines(tmp_path, one_thread):
    path = _checkpoint(tmp_path)
    model = load_model(path).float()
    tok = ByteTokenizer()
    pool = RolloutPool(model.config, tok, model.state_dict(), executor="inline")
    reqs = [RolloutRequest(f"p{i}", tok.encode(f"question {i}?"), 3) for i in range(3)]
    pool.submit(reqs, {"max_tokens": 10, "temperature": 0.8, "stop": ["\n"]})
    ((_, comps),) = pool.wait()
    with torch.no_grad():
        logp_BT, mask_BT = completion_logprobs(model, comps, temperature=0.8)
    for i, c in enumerate(comps):
        n = len(c.token_ids)
        assert int(mask_BT[i].sum()) == n
        torch.testing.assert_close(logp_BT[i, :n], torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def _cfg(tmp_path, **kw) -> RLRunConfig:
    base = dict(
        checkpoint=_checkpoint(tmp_path),
        out_dir=str(tmp_path / "rl"),
        steps=12,
        groups_per_step=4,
        group_size=8,
        max_draws=12,
        max_new_tokens=4,
        lr=1e-2,
        eval_problems=32,
        eval_interval=12,
        executor="inline",
        micro_batch_size=32,
    )
    return rl_run(**{**base, **kw})


def _envs():
    return MixtureEnvironment([lowercase_first_env()]), MixtureEnvironment(
        [lowercase_first_env(name="held")]
    )


def test_grpo_learns_a_verifiable_preference(tmp_path, one_thread):
    env, held = _envs()
    res = run_rl(_cfg(tmp_path, eval_samples=4), env=env, eval_env=held, progress=False)
    rewards = [r["reward_mean"] for r in res["train"]]
    # the held-out problems sampled at the RL temperature too (rl.eval_samples), 4 per problem
    first, last = res["eval"][0], res["eval"][-1]
    assert first["held/sampled_count"] == 4 * first["held/count"] == 128
    assert last["all/sampled"] > first["all/sampled"] + 0.2, (first, last)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.25, rewards
    # the verifier's verdict on every drawn sample: the reward itself for a 0/1 verifier
    assert [r["draw_solved"] for r in res["train"]] == rewards
    assert res["eval"][-1]["all/solved"] > res["eval"][0]["all/solved"], res["eval"]
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(set(r["staleness"]) <= {"0", "1"} for r in train)  # max_policy_lag 1
    assert any(r["groups_kept"] > 0 and "logprob_diff_mean" in r for r in train)
    # step 0 trains on rollouts of the very same weights: engine and trainer agree; later steps
    # include rollouts one version old, and the gap is the policy's change
    assert set(train[0]["staleness"]) == {"0"} and train[0]["logprob_diff_mean"] < 1e-3
    assert max(r.get("logprob_diff_mean", 0) for r in train) > 1e-3
    assert (tmp_path / "rl" / "rl.png").stat().st_size > 0
    load_model(tmp_path / "rl" / "model")


def test_difficulty_filter_runs_first_and_reports_pass_at_k(tmp_path, one_thread):
    """`data.difficulty_filter` samples the starting policy on the pool before step 1 (here the
    environment given to `run_rl`), keeps what it measured in range and writes its figures."""
    from hybridlm.rl.env_config import DifficultyFilterConfig

    env, held = _envs()
    cfg = _cfg(tmp_path, steps=1, eval_problems=4, eval_interval=1)
    cfg.data.difficulty_filter = DifficultyFilterConfig(problems=6, samples=4)
    run_rl(cfg, env=env, eval_env=held, progress=False)
    stats = json.loads((tmp_path / "rl" / "difficulty_filter.json").read_text())["envs"]
    (name,) = stats
    st = stats[name]
    assert st["pool"] == 6 and st["kept"] + st["dropped_solved"] + st["dropped_unsolved"] == 6
    assert 0 <= st["pass@1"] <= st["pass@4"] <= 1


def test_async_rollouts_on_ray_keep_the_lag_bounded(tmp_path):
    ray = pytest.importorskip("ray")
    env, held = _envs()
    cfg = _cfg(
        tmp_path, executor="ray", steps=3, eval_interval=3, eval_problems=8, sync_timeout_s=60
    )
    try:
        res = run_rl(cfg, env=env, eval_env=held, progress=False)
    finally:
        ray.shutdown()
    train = res["train"]
    assert len(train) == 3 and all(r["sync_s"] < 60 for r in train)
    # step 0 consumes version-0 rollouts; later steps may use rollouts one version old
    assert set(train[0]["staleness"]) == {"0"}
    assert all(set(r["staleness"]) <= {"0", "1"} for r in train)
    assert sum(r["groups_kept"] for r in train) > 0


def test_config_errors_are_actionable(tmp_path):
    with pytest.raises(ValueError, match="starting policy"):
        run_rl(RLRunConfig())  # checked when the run starts: the file may leave it to --checkpoint
    with pytest.raises(ValueError, match="rl.group_size"):
        rl_run(checkpoint="x", group_size=1).validate()
    with pytest.raises(ValueError, match="train.grad_accum has no effect in RL"):
        rl_run(checkpoint="x", grad_accum=2).validate()
    # the keys of the flat config before its sections: a file and an override say where they went
    old = tmp_path / "old.yaml"
    old.write_text("checkpoint: runs/sft\nsteps: 20\nlr: 1.0e-5\n")
    with pytest.raises(ValueError) as err:
        RLRunConfig.load(old)
    msg = str(err.value)
    assert "checkpoint is now train.init_from" in msg and "steps is now train.max_steps" in msg
    assert "\n" not in msg and "sections ['data', 'rl', 'train']" in msg
    with pytest.raises(ValueError, match=r"override 'reward=random': .*reward is now rl.reward"):
        RLRunConfig().override(["reward=random"])
    with pytest.raises(ValueError, match=r"grpo is now rl.grpo"):
        RLRunConfig().override(["grpo.eps_high=0.3"])


def test_the_runs_checkpoints_load_with_the_policys_tokenizer(tmp_path, one_thread):
    """An RL run's training checkpoints record the starting policy's tokenizer: the run
    directory loads with it (`hybridlm.io.load`), not with the byte tokenizer."""
    from hybridlm.data.bpe import train_bpe
    from hybridlm.io import load, tokenizer_spec_for

    texts = [
        f"What is {a} + {b}? The answer is {a + b}. abc ABC" for a in range(30) for b in (1, 2)
    ]
    tok = train_bpe(texts, vocab_size=300, min_frequency=1)
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern, cfg.mtp.pattern = 320, 64, "M*", ""
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.chunk_size = 2, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 2, 1, 32
    policy = tmp_path / "bpe_policy"
    save_pretrained(HybridLM(cfg, seed=0), policy, tokenizer=tok)
    env, held = _envs()
    run = _cfg(tmp_path, checkpoint=str(policy), steps=1, eval_problems=2, eval_interval=1)
    run_rl(run, env=env, eval_env=held, progress=False)
    (ckpt,) = (tmp_path / "rl" / "checkpoints").iterdir()
    assert tokenizer_spec_for(ckpt) == tokenizer_spec_for(policy) == str(policy)
    loaded = load(tmp_path / "rl")
    assert loaded.kind == "checkpoint" and loaded.tokenizer.encode("abc ABC") == tok.encode(
        "abc ABC"
    )


def test_rl_resume_repeats_the_uninterrupted_run(tmp_path, one_thread):
    """A run stopped after step 3 and resumed from its checkpoint logs the rows of the
    uninterrupted run: weights, optimizer, RNG and the rollout state (draw counter, sampling
    streams, finished calls and kept groups not yet trained on) are checkpointed."""
    env, held = _envs()
    full = _cfg(tmp_path, steps=6, eval_interval=3, eval_problems=8, checkpoint_interval=3)
    full.train.out_dir = str(tmp_path / "full")
    run_rl(full, env=env, eval_env=held, progress=False)
    part = _cfg(tmp_path, steps=6, eval_interval=3, eval_problems=8, checkpoint_interval=3)
    part.train.out_dir = str(tmp_path / "part")
    run_rl(part, env=env, eval_env=held, progress=False, until_step=3)
    resumed = run_rl(part, env=env, eval_env=held, progress=False, resume=True)
    assert resumed["step"] == 6

    def rows(out):
        drop = ("wait_s", "train_s", "sync_s", "steps_per_s")
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in drop} for x in lines]

    assert rows("part") == rows("full")
