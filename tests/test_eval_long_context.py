"""Long-context measurements (eval/long_context.py): bpb by position against a per-token
recomputation, RULER per length with the paired gain, cache and activation bytes, the copy
probe, and the plot."""

import math

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.data.bpb import token_byte_lengths
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.long_context import (
    activation_bytes_per_token,
    cache_bytes,
    copy_probe,
    paired_gain,
    plot_long_context,
    position_bpb,
    position_change,
    ruler_by_length,
)
from hybridlm.model.model import HybridLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    cfg = tiny_train_model(mtp=False)
    cfg.max_seq_len = 1024
    return HybridLM(cfg, seed=0).eval()


def test_position_bpb_equals_a_per_token_recomputation(model):
    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 65, 40)]
    res = position_bpb(model, docs, length=64, bucket=16, tokenizer=tok, batch_size=2)
    assert res["documents"] == 2 and res["bucket_start"] == [0, 16, 32, 48]  # 40 is too short
    nbytes = token_byte_lengths(tok, model.config.vocab_size)
    nats, byts = [0.0] * 4, [0.0] * 4
    for d in docs[:2]:
        ids = torch.tensor([d[:65]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)[0]
        for j in range(64):  # target j + 1, predicted at position j
            nats[j // 16] -= float(logp[j, ids[0, j + 1]])
            byts[j // 16] += float(nbytes[ids[0, j + 1]])
    want = [n / (math.log(2) * b) for n, b in zip(nats, byts, strict=True)]
    assert res["bpb"] == pytest.approx(want, rel=1e-5)
    assert res["bpb_all"] == pytest.approx(sum(nats) / (math.log(2) * sum(byts)), rel=1e-5)
    with pytest.raises(ValueError, match="no document has 1001 tokens"):
        position_bpb(model, docs, length=1000, bucket=100, tokenizer=tok)


def test_ruler_by_length_scores_every_sample_and_the_paired_gain(model):
    tok = ByteTokenizer()
    res = ruler_by_length(model, tok, lengths=[500, 700], tasks=["vt", "cwe"], num_samples=3)
    assert set(res["scores"]) == {"vt", "cwe"}
    assert all(len(res["scores"][t][L]) == 3 for t in ("vt", "cwe") for L in (500, 700))
    assert res["overall"][500] == pytest.approx(
        (sum(res["scores"]["vt"][500]) + sum(res["scores"]["cwe"][500])) / 6
    )
    before = {"tasks": ["a"], "scores": {"a": {4: [0.0, 0.0, 0.5, 0.0]}}}
    after = {"tasks": ["a"], "scores": {"a": {4: [1.0, 0.0, 1.0, 1.0]}}}
    g = paired_gain(after, before, 4)
    diffs = [1.0, 0.0, 0.5, 1.0]
    sd = math.sqrt(sum((d - 0.625) ** 2 for d in diffs) / 3)
    assert g["gain"] == pytest.approx(0.625) and g["se"] == pytest.approx(sd / 2)
    assert g["pairs"] == 4 and g["z"] == pytest.approx(0.625 / (sd / 2))
    same = paired_gain(before, before, 4)  # nothing moved: no evidence either way
    assert same["gain"] == 0 and same["se"] == 0 and same["z"] == 0


def test_cache_grows_with_attention_only_and_activation_bytes_are_counted(model):
    cfg = model.config
    c64, c256 = cache_bytes(model, 64), cache_bytes(model, 256)
    attn = cfg.pattern.count("*")
    per_token = attn * 2 * cfg.attention.num_kv_heads * cfg.attention.head_dim * 4  # fp32 K, V
    assert c256 - c64 == per_token * 192  # the Mamba state does not grow with the context
    a = activation_bytes_per_token(model, 64)
    # at least the logits (fp32) of every position are saved for the backward
    assert a >= cfg.vocab_size * 4
    assert all(p.grad is None for p in model.parameters())


def test_copy_probe_on_a_model_that_copies():
    class Copier(torch.nn.Module):
        """Predicts token t - 64 at position t (the first copy is random to it)."""

        config = type("C", (), {"vocab_size": 400})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids):
            logits = torch.zeros(*ids.shape, 400)
            logits[:, 63:, :].scatter_(-1, ids[:, :-63, None], 30.0)
            return type("O", (), {"logits": logits})()

    res = copy_probe(Copier())
    assert res["second"] < 0.01 < res["first"] and res["uniform"] == pytest.approx(math.log(26))


def test_position_change_is_paired_over_documents():
    # two documents, two buckets: (nats, bytes) per bucket
    before = {"bucket_start": [0, 8], "per_document": [[[8, 4], [6, 4]], [[4, 4], [4, 4]]]}
    after = {"bucket_start": [0, 8], "per_document": [[[8, 4], [2, 4]], [[4, 4], [2, 4]]]}
    ch = position_change(before, after)
    d = [-1.0 / math.log(2), -0.5 / math.log(2)]  # per-document changes in bucket 1 (bits)
    assert ch["mean"][0] == 0 and ch["se"][0] == 0
    assert ch["mean"][1] == pytest.approx(sum(d) / 2)
    assert ch["se"][1] == pytest.approx(abs(d[0] - d[1]) / 2)
    assert ch["docs"] == 2


def test_plot_long_context(tmp_path):
    res = {
        "ruler": {"lengths": [256, 512], "overall": {256: 0.5, 512: 0.2}},
        "position_bpb": {"bucket": 128, "bucket_start": [0, 128], "bpb": [1.5, 1.4]},
    }
    ch = {"bucket_start": [0, 128], "mean": [0.0, -0.1], "se": [0.01, 0.02], "docs": 3}
    png = plot_long_context(
        {"a": res, "b": res}, tmp_path / "x" / "lc.png", changes={"a": ch}, original=256
    )
    assert png.is_file() and png.stat().st_size > 1000
