"""Rollout workers: groups sampled in one batch with the engine's log-probs, in-flight weight
updates tagged by version, and the Ray pool across processes (a local cluster) with a weight-sync
timeout that fails loudly."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.rollout import RolloutPool, RolloutRequest, RolloutWorker
from hybridlm.presets import get_preset


def _policy(seed: int = 0) -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.pattern, cfg.mtp.pattern = 258, "M*ME", ""
    return HybridLM(cfg, seed=seed).eval()


def _requests(n: int, group: int) -> list[RolloutRequest]:
    tok = ByteTokenizer()
    return [RolloutRequest(f"p{i}", tok.encode(f"{i} + {i} ="), group) for i in range(n)]


PARAMS = {"max_tokens": 12, "temperature": 1.0}


def test_inline_groups_carry_logprobs_stop_tokens_and_versions(one_thread):
    model = _policy()
    pool = RolloutPool(model.config, ByteTokenizer(), model.state_dict(), executor="inline")
    pool.submit(_requests(3, 4), PARAMS)
    ((_, comps),) = pool.wait()
    assert [(c.key, c.index) for c in comps] == [(f"p{i}", g) for i in range(3) for g in range(4)]
    texts = {c.text for c in comps}
    assert len(texts) > 1  # group members are different samples
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
        assert set(c.versions) == {0} and all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "stop":  # the EOS that ended it is part of the completion
            assert c.token_ids[-1] == ByteTokenizer.eos_id
    # the behaviour log-probs are the policy's: a teacher-forced forward reproduces them
    c = comps[0]
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float(), -1)
    ref = logp.gather(-1, ids[0, len(c.prompt_ids) :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-5, rtol=0)


def test_weights_handed_over_mid_generation_apply_at_a_step_boundary(one_thread):
    model, new = _policy(0), _policy(1)
    worker = RolloutWorker(model.config, ByteTokenizer(), model.state_dict())
    params = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    result: list = []
    t = threading.Thread(target=lambda: result.extend(worker.generate(_requests(2, 2), params)))
    t.start()
    deadline = time.monotonic() + 60
    while worker.engine.stats["decode_steps"] < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert worker.set_weights(new.state_dict(), version=1) == 1
    t.join(60)
    for c in result:
        n_old = c.versions.count(0)
        assert 5 <= n_old < 40 and c.versions == [0] * n_old + [1] * (40 - n_old)
    assert worker.version() == 1
    with pytest.raises(ValueError, match="older"):
        worker.set_weights(model.state_dict(), version=0)


def test_ray_pool_generates_in_other_processes_and_sync_times_out_loudly():
    ray = pytest.importorskip("ray")
    model = _policy()
    pool = RolloutPool(
        model.config,
        ByteTokenizer(),
        model.state_dict(),
        executor="ray",
        num_workers=1,
        sync_timeout_s=30,
    )
    try:
        inline = RolloutWorker(model.config, ByteTokenizer(), model.state_dict())
        pool.submit(_requests(2, 3), {**PARAMS, "temperature": 0.0})
        ((_, comps),) = pool.wait(timeout=60)
        # greedy: the actor's completions equal this process's
        ref = inline.generate(_requests(2, 3), {**PARAMS, "temperature": 0.0})
        assert [c.token_ids for c in comps] == [c.token_ids for c in ref]
        assert pool.set_weights(_policy(1).state_dict(), version=1) < 30
        # all three of the actor's call slots busy with long generations (a hung worker): the
        # hand-over cannot be acknowledged within the timeout, and the pool says so instead
        # of hanging
        long = {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True}
        for _ in range(3):
            pool.submit(_requests(4, 4), long)
        pool.sync_timeout_s = 0.2
        with pytest.raises(TimeoutError, match="timed out"):
            pool.set_weights(model.state_dict(), version=2)
    finally:
        pool.shutdown()
        ray.shutdown()


def test_ray_workers_ask_for_gpus_when_the_cluster_has_them():
    from hybridlm.infer.rollout import worker_gpus

    assert worker_gpus(None, 0.0, 2) == 0.0  # a laptop: the CPU
    assert worker_gpus(None, 8.0, 2) == 1.0  # one each
    assert worker_gpus(None, 1.0, 4) == 0.25  # a share of the one there is
    assert worker_gpus(0, 8.0, 2) == 0.0  # told to stay on the CPU
    assert worker_gpus(2, 8.0, 2) == 2.0
    with pytest.raises(ValueError, match="Ray cluster has 1"):
        worker_gpus(1, 1.0, 2)
    with pytest.raises(ValueError, match=">= 0"):
        worker_gpus(-1, 1.0, 1)


def test_concurrent_calls_share_one_continuous_batch(one_thread):
    """A call that arrives while another runs (a prefetched draw; a Ray actor runs two) joins
    the same engine batch at the next step instead of waiting for the first to end."""
    model = _policy()
    worker = RolloutWorker(model.config, ByteTokenizer(), model.state_dict())
    sizes: list[int] = []
    step = worker.engine.step

    def spy():
        sizes.append(len(worker.engine._running))
        return step()

    worker.engine.step = spy
    params = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    out: dict[int, list] = {}

    def call(k: int) -> None:
        out[k] = worker.generate(_requests(2, 2), params)

    first = threading.Thread(target=call, args=(0,))
    first.start()
    deadline = time.monotonic() + 60
    while worker.engine.stats["decode_steps"] < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    second = threading.Thread(target=call, args=(1,))
    second.start()
    first.join(60)
    second.join(60)
    assert max(sizes) == 8  # 2 calls x 2 prompts x 2 samples, in one batch
    assert sorted(out) == [0, 1] and all(len(c.token_ids) == 40 for k in out for c in out[k])
    assert worker.calls() == 2


def test_a_failing_environment_ends_its_call_and_the_worker_goes_on(one_thread):
    from hybridlm.rl.environments import ArithmeticEnvironment

    class Broken(ArithmeticEnvironment):
        def score(self, problem, completion):
            raise RuntimeError("the verifier crashed")

    model = _policy()
    env = Broken(num_problems=2)
    worker = RolloutWorker(model.config, ByteTokenizer(), model.state_dict(), env=env)
    reqs = [RolloutRequest(p.id, [], 2, problem=p) for p in env]
    from _tiny import ForcedTokens

    reply = ByteTokenizer().encode("hi<|im_end|>", add_bos=False)  # a reply that gets scored
    params = {"max_tokens": 20, "constraint": lambda: ForcedTokens(reply, 258)}
    with pytest.raises(RuntimeError, match="verifier crashed"):
        worker.generate(reqs, params)
    assert not worker.engine.has_unfinished()  # its requests were dropped
    comps = worker.generate(_requests(1, 2), PARAMS)  # the worker still serves
    assert len(comps) == 2


def test_a_prompt_the_engine_refuses_ends_only_its_call(one_thread):
    model = _policy()
    worker = RolloutWorker(model.config, ByteTokenizer(), model.state_dict())
    with pytest.raises(ValueError):
        worker.generate([RolloutRequest("empty", [], 2)], PARAMS)  # no prompt tokens
    assert not worker.engine.has_unfinished()
    assert len(worker.generate(_requests(1, 2), PARAMS)) == 2
