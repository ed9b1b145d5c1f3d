import os
from pathlib import Path

import pytest

from hybridlm.threads import configure_threads

# a pinned count: tests are repeatable, and no thread governor changes it under a test
configure_threads(max(1, min(2, os.cpu_count() or 1)))

import torch  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, so runs are repeatable."""
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, the originals of the packaged data sets (`hybridlm.data.builtin`), or
    skip: a fresh clone has no ../shared. Tests read the packaged copies; only the checksum
    comparison with the originals needs this."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data is not present")
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread for batch-1 decoding and tiny training runs: extra threads only add
    synchronisation there, and on a machine where another process holds a core two threads make
    these tests tens of times slower. Results are also independent of the core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tool_policy(tmp_path_factory) -> str:
    """tiny_train_model after 150 steps of SFT on calculator demonstrations (2-digit products):
    it writes well-formed calculator calls with the right operands, then an answer (usually
    not the tool's result: rewards vary, which RL needs). ~20 s on one core."""
    from _tiny import tiny_train_model
    from hybridlm import HybridLM
    from hybridlm.data.sft import encode_chat
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.interop.hf import save_pretrained
    from hybridlm.rl.environments import CalculatorEnvironment

    tok = ByteTokenizer()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    env = CalculatorEnvironment(num_problems=200, digits=2, seed=0)
    demos = [encode_chat(c, tok) for c in env.demonstrations(64, seed=0)]
    cfg = tiny_train_model(mtp=False)
    cfg.max_seq_len = 2048
    model = HybridLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        rows = [demos[i] for i in torch.randint(len(demos), (4,), generator=g).tolist()]
        L = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        mask = torch.zeros(len(rows), L, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r.input_ids)
            mask[i, : len(r)] = torch.tensor(r.loss_mask)
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits[mask[:, 1:]].float(), ids[:, 1:][mask[:, 1:]]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(before)
    path = tmp_path_factory.mktemp("tool_policy") / "policy"
    save_pretrained(model.eval(), path, tokenizer=tok)
    return str(path)
