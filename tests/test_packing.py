"""Intra-document masking for packed rows: no attention, conv tap or SSD state crosses a
document boundary, and positions restart, so each document computes what it would alone."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.ops.conv1d import causal_conv1d, causal_conv1d_docs
from hybridlm.ops.ssd import ssd_chunked, ssd_recurrent
from hybridlm.presets import get_preset
from hybridlm.train.objectives import causal_lm_loss

DOCS = torch.tensor(
    [
        [0] * 5 + [1] * 4 + [2] * 21 + [3] * 7,  # boundaries inside and at chunk edges
        [0] * 16 + [1] + [2] * 20,  # a one-token document
    ]
)


def _segments(doc_L):
    for d in doc_L.unique():
        idx = (doc_L == d).nonzero()[:, 0]
        yield int(idx[0]), int(idx[-1]) + 1


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_ssd_chunked_with_documents_equals_each_document_alone(chunk):
    g = torch.Generator().manual_seed(0)
    B, L, H, P, G, N = 2, DOCS.shape[1], 4, 8, 2, 16

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, Bm, Cm, D = r(B, L, H, P), r(B, L, G, N), r(B, L, G, N), r(H)
    dt = torch.rand(B, L, H, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 3
    y, state = ssd_chunked(x, dt, A, Bm, Cm, D, chunk, doc_ids_BL=DOCS)
    y_ref, state_ref = ssd_recurrent(x, dt, A, Bm, Cm, D, doc_ids_BL=DOCS)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(state, state_ref, atol=1e-12, rtol=0)
    for b in range(B):
        for s, e in _segments(DOCS[b]):
            sl = slice(s, e)
            alone, _ = ssd_recurrent(
                x[b : b + 1, sl], dt[b : b + 1, sl], A, Bm[b : b + 1, sl], Cm[b : b + 1, sl], D
            )
            torch.testing.assert_close(y[b, sl], alone[0], atol=1e-12, rtol=0)


def test_conv_with_documents_equals_each_document_alone():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, DOCS.shape[1], 12, generator=g, dtype=torch.float64)
    w, b = (
        torch.randn(12, 4, generator=g, dtype=torch.float64),
        torch.randn(12, dtype=torch.float64),
    )
    y = causal_conv1d_docs(x, w, b, DOCS)
    for r in range(2):
        for s, e in _segments(DOCS[r]):
            alone, _ = causal_conv1d(x[r : r + 1, s:e], w, b)
            torch.testing.assert_close(y[r, s:e], alone[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["tiny-super", "tiny-lightning", "tiny-olmo"])
def test_packed_row_equals_each_document_alone(name):
    cfg = get_preset(name)
    cfg.vocab_size = 300
    if "M" in cfg.pattern:
        cfg.mamba.chunk_size = 8
    if name == "tiny-olmo":
        cfg.attention.sliding_window = 6
    model = HybridLM(cfg, seed=0).double().eval()
    ids = torch.randint(0, 300, DOCS.shape, generator=torch.Generator().manual_seed(2))
    logits = model(ids, doc_ids=DOCS).logits
    for b in range(2):
        for s, e in _segments(DOCS[b]):
            alone = model(ids[b : b + 1, s:e]).logits[0]
            torch.testing.assert_close(logits[b, s:e], alone, atol=1e-10, rtol=0)


def test_packed_training_loss_backward_and_errors():
    cfg = get_preset("tiny-super")
    cfg.vocab_size = 300
    model = HybridLM(cfg, seed=0)
    ids = torch.randint(0, 300, DOCS.shape)
    out = model(ids, doc_ids=DOCS, mtp_depth=model.train_mtp_depth, return_logits=False)
    loss, _ = causal_lm_loss(model, out, ids, doc_ids=DOCS)
    loss.backward()
    assert torch.isfinite(loss) and model.layers[0].mixer.in_proj.weight.grad is not None
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, doc_ids=DOCS.flip(1))
    with pytest.raises(ValueError, match="shape"):
        model(ids, doc_ids=DOCS[:, :5])


def test_packed_mtp_targets_stay_inside_their_document():
    """MTP depth k at position t predicts token t+k+1: in a packed row that target may belong
    to the next document, which the model (masked to its own document) cannot see. Those
    targets are dropped, so the packed MTP loss equals the per-document losses pooled."""
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mtp.depth = 300, 2
    model = HybridLM(cfg, seed=0).double()
    ids = torch.randint(0, 300, DOCS.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, doc_ids=DOCS, mtp_depth=2)
        packed = causal_lm_loss(model, out, ids, doc_ids=DOCS)[1]
    for k in (1, 2):
        total, count = 0.0, 0
        for b in range(2):
            for s, e in _segments(DOCS[b]):
                n = e - s - k - 1  # positions with a target inside the document
                if n <= 0:
                    continue
                x = ids[b : b + 1, s:e]
                with torch.no_grad():
                    out = model(x, mtp_depth=2)
                    alone = causal_lm_loss(model, out, x, num_valid_tokens=1)[1][f"mtp_{k}"]
                total, count = total + float(alone), count + n
        # without num_valid_tokens each depth is a mean over its own valid targets
        got = float(packed[f"mtp_{k}"])
        assert got == pytest.approx(total / count, rel=1e-9), (k, got, total / count)
