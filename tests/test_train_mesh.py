"""Layouts beyond plain data parallelism on CPU (gloo, 127.0.0.1): expert parallelism (EP) over
the data-parallel shard group, composed with FSDP2 and HSDP. Each layout's per-step losses and
gradient norms and its weights after 3 steps equal the single process with the same global batch
(fp32, 1e-5 relative for the losses; weights in norm, `WEIGHT_TOL`): only the order of
floating-point sums differs. Context parallelism is also compared with the single process in
fp64 (logits, loss, every gradient) on rows of packed documents that cross the shards, and
every mode's test is shown to fail with a deliberately broken collective (`tests/_broken.py`)."""

import textwrap
from pathlib import Path

import pytest
import torch

from hybridlm.presets import get_preset
from hybridlm.train.config import ParallelConfig, TrainConfig
from hybridlm.train.distributed.parallel import resolve_layout
from hybridlm.train.stages.pretrain import run_pretrain
from test_train_parallel import (
    PRETRAIN_KEYS,
    _free_port,
    assert_same_losses,
    assert_same_weights,
    launch,
    rows,
    run_world2,
    tiny_run,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _parity(
    tmp_path, name: str, world: int, batch_per_rank: int, train=None, model=None, **layout
) -> None:
    """`name` under `layout` at `world` ranks vs one process (tiny-super unless `model`)."""
    # the ranks of a context- or tensor-parallel group read the same rows
    rows_per_step = batch_per_rank * world // layout.get("cp", 1) // layout.get("tp", 1)
    ref = tiny_run(tmp_path, "w1", batch_size=rows_per_step)
    parallel = ParallelConfig(**layout)
    run = tiny_run(tmp_path, name, batch_size=batch_per_rank, parallel=parallel, **(train or {}))
    if model is not None:
        ref.model = run.model = model
    run_pretrain(ref)
    run_world2(tmp_path, run, world=world)
    a, b = rows(run.train.out_dir), rows(ref.train.out_dir)
    assert sum(r["kind"] == "train" for r in a) == 3
    loss = assert_same_losses(a, b, PRETRAIN_KEYS)
    weights = assert_same_weights(run.train.out_dir, ref.train.out_dir)
    print(f"{name}: worst relative loss difference {loss:.2e}, weights {weights:.2e}")


def test_ep2_world2_matches_single_process(tmp_path):
    _parity(tmp_path, "ep2", world=2, batch_per_rank=2, ep=2)


@pytest.mark.slow
def test_ep2_fsdp4_world4_matches_single_process(tmp_path):
    """EP 2 inside a dp_shard group of 4: the experts are also FSDP-sharded over the 2 ranks
    the expert-parallel group leaves."""
    _parity(tmp_path, "ep2_fsdp4", world=4, batch_per_rank=1, ep=2)


@pytest.mark.slow
def test_ep2_hsdp_world4_matches_single_process(tmp_path):
    """HSDP (2 replicas x 2 shards) with EP 2 in each shard group."""
    _parity(tmp_path, "ep2_hsdp", world=4, batch_per_rank=1, dp_replicate=2, dp_shard=2, ep=2)


META_INIT_WORKER = textwrap.dedent(
    """
    import copy, sys
    import torch
    from hybridlm.model.model import HybridLM, build_model
    from hybridlm.presets import get_preset
    from hybridlm.train.config import ParallelConfig
    from hybridlm.train.distributed import parallel as P

    rank, world, dev = P.init_distributed("cpu")
    cfg = get_preset("tiny-super")
    cfg.mtp.shared = sys.argv[3] == "shared"  # per-depth heads: each its own shards
    pc = ParallelConfig(dp_shard=-1, ep=int(sys.argv[1]), tp=int(sys.argv[2]))
    layout = P.resolve_layout(pc, world)
    with torch.device("meta"):
        model = HybridLM(cfg)
    template = copy.deepcopy(model)
    P.apply_layout(model, layout, P.build_mesh(layout, dev))
    P.materialize_sharded(model, template, seed=11, device=dev)
    held = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    full = P.full_model_state(model)
    every = P.full_model_state(model, every_rank=True)  # what a finished Trainer hands back
    ref = build_model(cfg, seed=11, device=torch.device("cpu")).state_dict()
    assert every.keys() == ref.keys(), set(every) ^ set(ref)
    assert not [k for k in ref if not torch.equal(every[k], ref[k])]
    if rank == 0:
        assert full.keys() == ref.keys(), set(full) ^ set(ref)
        bad = [k for k in ref if not torch.equal(full[k], ref[k])]
        assert not bad, bad
        print("held", held, "of", sum(p.numel() for p in template.parameters()))
    P.destroy()
    """
)


@pytest.mark.parametrize(
    ("world", "ep", "tp", "mtp"),
    [
        (2, 2, 1, "shared"),
        (2, 1, 2, "shared"),
        pytest.param(2, 1, 2, "per_depth", marks=pytest.mark.slow),
        pytest.param(4, 2, 1, "shared", marks=pytest.mark.slow),
    ],
    ids=["ep2", "tp2", "tp2_per_depth_mtp", "ep2_fsdp4"],
)
def test_meta_init_gives_each_rank_its_shard_of_the_single_process_init(
    tmp_path, world, ep, tp, mtp
):
    """A sharded layout built on the meta device: every rank allocates only its shards, and the
    gathered weights equal one process's seeded init bit for bit (tiny-super: Mamba, LatentMoE,
    attention, MTP). FSDP2 + EP 2; TP 2 (Mamba-2's rows in rank order, gathered back to the
    canonical order); world 4 also FSDP-shards the experts over 2 ranks."""
    logs = launch(tmp_path, META_INIT_WORKER, [str(ep), str(tp), mtp], world=world)
    held, total = (int(w) for w in logs[0].split("held ")[1].split()[:3:2])
    print(f"world {world}: rank 0 holds {held:,} of {total:,} parameters")
    # TP 2 alone keeps the router, latent projections, norms and eh_proj whole (52% measured)
    assert held < total * 0.6, (held, total)


def test_layout_resolution_and_errors():
    assert resolve_layout(ParallelConfig(ep=2), 4).dp_shard == 4
    lay = resolve_layout(ParallelConfig(dp_replicate=-1, dp_shard=2, ep=2), 8)
    assert (lay.dp_replicate, lay.dp_shard, lay.ep, lay.style) == (4, 2, 2, "fsdp")
    assert resolve_layout(TrainConfig(parallel="ddp").layout(), 4).style == "ddp"
    lay = resolve_layout(ParallelConfig(dp_shard=-1, tp=2, cp=2), 8)
    assert (lay.dp_shard, lay.tp, lay.cp, lay.dp, lay.style) == (2, 2, 2, 2, "fsdp")
    with pytest.raises(ValueError, match="x tp 2 = 8 ranks, but this job has 4"):
        resolve_layout(ParallelConfig(dp_shard=4, tp=2), 4)
    with pytest.raises(ValueError, match="must divide dp_shard"):
        resolve_layout(ParallelConfig(dp_shard=2, dp_replicate=2, ep=4), 4)
    with pytest.raises(ValueError, match="= 4 ranks, but this job has 2"):
        resolve_layout(ParallelConfig(dp_shard=2, dp_replicate=2), 2)
    with pytest.raises(ValueError, match="do not split"):
        resolve_layout(ParallelConfig(dp_replicate=-1, dp_shard=3), 4)
    with pytest.raises(ValueError, match="positive number of ranks"):
        ParallelConfig(ep=0)
    with pytest.raises(ValueError, match="train.parallel.tp must be a positive"):
        ParallelConfig(tp=-1)


def test_expert_dispatch_is_pluggable_and_local_by_default():
    """The model's experts call a dispatch with the local signature; the default computes
    locally, so model code needs no collective."""
    from hybridlm.model.moe import Experts, run_local

    ex = Experts(4, 8, 16)
    torch.nn.init.normal_(ex.up_proj)
    torch.nn.init.normal_(ex.down_proj)
    assert ex.dispatch is run_local
    calls = []

    def spy(fn, z, counts, up, down):
        calls.append(list(counts))
        return fn(z, counts, up, down)

    z = torch.randn(5, 8)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]])
    w = torch.rand(5, 2)
    ex.impl = "loop"
    ref = ex(z, idx, w)
    ex.dispatch = spy
    assert torch.equal(ex(z, idx, w), ref) and calls == [[3, 3, 2, 2]]


# slow: the default suite checks the same exchanges exactly in fp64
# (test_cp_documents_across_shards_match_single_process_exactly) and the trainer's context
# parallelism on packed rows (test_cp2_packed_documents_world2_matches_single_process)
@pytest.mark.slow
def test_cp2_world2_matches_single_process(tmp_path):
    """Context parallelism: every row split over 2 ranks (attention K/V gathered, Mamba states
    passed across shards, MTP reading across the boundary)."""
    _parity(tmp_path, "cp2", world=2, batch_per_rank=4, dp_shard=1, cp=2)


@pytest.mark.parametrize(
    "alternate",
    [pytest.param(False, marks=pytest.mark.slow), True],  # the alternating run has both lengths
    ids=["one_length", "long_and_short"],
)
def test_cp2_packed_documents_world2_matches_single_process(tmp_path, alternate):
    """Intra-document masking across shard boundaries: attention, conv taps and the SSD state
    stop at document starts in whichever shard they fall. `long_and_short` is the long-context
    stage's layout: rows of 64 and 16 tokens in turn (`data.alternate`), each split over the 2
    context-parallel ranks."""
    from hybridlm.data.config import AlternateConfig

    alt = AlternateConfig(seq_len=16, batch_size=4, batches=1) if alternate else None
    ref = tiny_run(tmp_path, "w1_docs", batch_size=4, intra_doc_masking=True)
    ref.data.alternate = alt
    run_pretrain(ref)
    run = tiny_run(
        tmp_path,
        "cp2_docs",
        batch_size=4,
        intra_doc_masking=True,
        parallel=ParallelConfig(dp_shard=1, cp=2),
    )
    run.data.alternate = alt
    run_world2(tmp_path, run, world=2)
    assert_same_losses(rows(run.train.out_dir), rows(ref.train.out_dir), PRETRAIN_KEYS)
    assert_same_weights(run.train.out_dir, ref.train.out_dir)


CP_EXACT_WORKER = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[1])
    import _broken
    _broken.install_from_env()
    from _tiny import tiny_train_model
    from hybridlm.model.model import build_model
    from hybridlm.train.distributed import parallel as P
    from hybridlm.train.distributed.context_parallel import apply_context_parallel
    from hybridlm.train.objectives import causal_lm_loss

    # fp64: what is left is the summation order (measured <= 1e-15); the router's weight stays
    # fp32 in an fp64 model (MoE router in fp32), so its gradient sums fp32 terms in another
    # order (measured 5e-8)
    TOL = {torch.float64: 1e-9, torch.float32: 1e-6}
    rank, world, dev = P.init_distributed("cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cfg = tiny_train_model()  # Mamba-2 (SSD chunks of 16), LatentMoE, attention; MTP depth 2
    Ls = 32  # shard length: two SSD chunks
    L = Ls * world
    ids = torch.randint(0, cfg.vocab_size, (3, L), generator=torch.Generator().manual_seed(0))
    # document starts: row 0 none (one document through every shard); row 1 inside the first
    # chunk, exactly at the first shard boundary and inside a later shard; row 2 a document from
    # position 5 to L - 4, longer than a shard, across every boundary (at cp 4 it also passes
    # whole shards that no document starts in)
    starts = [[], [10, Ls, Ls + 13], [5, L - 4]]
    docs = torch.zeros_like(ids)
    for row, cut in enumerate(starts):
        for t in cut:
            docs[row, t:] += 1
    own = slice(rank * Ls, (rank + 1) * Ls)

    def rel(a, b):
        return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-300))

    for doc_ids in (None, docs):
        ref = build_model(cfg, seed=0, device=dev).double().train()
        model = build_model(cfg, seed=0, device=dev).double().train()
        cp = apply_context_parallel(model, mesh)
        assert cp.shard(ids).shape[1] == Ls
        n = ids[:, 1:].numel()  # the whole rows' targets normalise every rank's part
        out_ref = ref(ids, doc_ids=doc_ids, mtp_depth=2)
        loss_ref = causal_lm_loss(ref, out_ref, ids, doc_ids=doc_ids, num_valid_tokens=n)[0]
        loss_ref.backward()
        mine = None if doc_ids is None else cp.shard(doc_ids)
        out = model(cp.shard(ids), doc_ids=mine, mtp_depth=2)
        loss = causal_lm_loss(
            model, out, ids, doc_ids=doc_ids, num_valid_tokens=n, seq_slice=own
        )[0]
        loss.backward()
        errs = {"logits": rel(out.logits, out_ref.logits[:, own])}
        for k, (a, b) in enumerate(zip(out.mtp_logits, out_ref.mtp_logits, strict=True), 1):
            errs[f"mtp_{k} logits"] = rel(a, b[:, own])
        errs["loss"] = rel(cp.sum(loss), loss_ref)  # each rank holds its shard's part
        tol = dict.fromkeys(errs, TOL[torch.float64])
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad
            want = grads[name].grad
            errs[f"grad {name}"] = rel(cp.sum(g), torch.zeros_like(g) if want is None else want)
            tol[f"grad {name}"] = TOL[p.dtype]
        worst = max(errs, key=lambda k: errs[k] / tol[k])
        f64 = max((k for k in errs if tol[k] == TOL[torch.float64]), key=errs.get)
        print(
            f"rank {rank} doc_ids {doc_ids is not None}: worst {worst} {errs[worst]:.1e}, "
            f"worst fp64 {f64} {errs[f64]:.1e}"
        )
        bad = sorted((k for k in errs if not errs[k] <= tol[k]), key=lambda k: -errs[k] / tol[k])
        listed = ", ".join(f"{k} {errs[k]:.1e}" for k in bad[:4])
        assert not bad, f"{len(bad)} differ, worst: {listed}"
    P.destroy()
    """
)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_documents_across_shards_match_single_process_exactly(tmp_path, world):
    """Context parallelism on rows no rank holds whole, in fp64 (one forward + backward, no
    trainer): every rank's logits (main and MTP), the sum of the ranks' losses and the summed
    gradients of every parameter equal the single process's on the whole rows, without and
    with packed documents that start inside shards and chunks, at a shard boundary, and run
    across one (world 2) or several (world 4) boundaries."""
    logs = launch(tmp_path, CP_EXACT_WORKER, [str(Path(__file__).parent)], world=world)
    print("".join(line for log in logs[:1] for line in log.splitlines(True) if "worst" in line))


def tiny_olmo():
    """tiny-olmo shrunk: sliding windows of 16 tokens (they cross the shard boundary of a
    64-token row split in 2), YaRN on the full layer, QK-norm, SwiGLU, post-norm."""
    m = get_preset("tiny-olmo")
    m.vocab_size, m.d_model, m.mlp.hidden = 258, 64, 128
    m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim = 4, 2, 16
    m.attention.sliding_window = 16
    m.validate()
    return m


def test_cp2_olmo_sliding_window_yarn_world2_matches_single_process(tmp_path):
    _parity(tmp_path, "cp2_olmo", world=2, batch_per_rank=4, model=tiny_olmo(), dp_shard=1, cp=2)


@pytest.mark.slow
def test_cp2_ep2_world4_matches_single_process(tmp_path):
    """Context and expert parallelism together: 2 rows per step, each split over a cp pair,
    experts split over an ep pair, parameters sharded over all 4 ranks."""
    _parity(tmp_path, "cp2_ep2", world=4, batch_per_rank=1, dp_shard=2, cp=2, ep=2)


STEPS = dict(max_steps=4, eval_interval=2, checkpoint_interval=2)


@pytest.mark.parametrize(
    ("save", "resume"),
    [
        ({"ep": 2}, None),  # EP 2 at world 2 -> one process
        pytest.param(  # CP 2 -> EP 2 (experts resharded)
            {"dp_shard": 1, "cp": 2}, {"ep": 2}, marks=pytest.mark.slow
        ),
        ({"dp_shard": 1, "tp": 2}, {"ep": 2}),  # TP 2 -> EP 2 (heads, vocabulary regathered)
    ],
    ids=["ep2->world1", "cp2->ep2", "tp2->ep2"],
)
def test_sharded_checkpoint_resumes_at_another_layout(tmp_path, save, resume):
    """A sharded (DCP) checkpoint written under one layout resumes under another: the rest of
    the run has the losses of the uninterrupted single process."""
    ref = tiny_run(tmp_path, "ref", batch_size=4, **STEPS)
    run_pretrain(ref)
    # a cp or tp pair reads the same rows
    part_batch = 4 if save.get("cp", 1) * save.get("tp", 1) > 1 else 2
    part = tiny_run(
        tmp_path, "part", batch_size=part_batch, parallel=ParallelConfig(**save), **STEPS
    )
    run_world2(tmp_path, part, until_step=2)
    if resume is None:
        cont = tiny_run(tmp_path, "part", batch_size=4, **STEPS)
        run_pretrain(cont, resume=True)
    else:
        cont = tiny_run(tmp_path, "part", batch_size=2, parallel=ParallelConfig(**resume), **STEPS)
        run_world2(tmp_path, cont, resume=True)
    worst = assert_same_losses(rows(cont.train.out_dir), rows(ref.train.out_dir), PRETRAIN_KEYS)
    weights = assert_same_weights(cont.train.out_dir, ref.train.out_dir)
    print(f"{save} -> {resume or 'world 1'}: worst relative difference {worst:.2e}, {weights:.2e}")


def test_tp2_world2_matches_single_process(tmp_path):
    """Tensor parallelism on tiny-super: attention heads, the shared expert's hidden units and
    the vocabulary (embeddings, LM head, vocabulary-parallel CE for the main and MTP losses)
    split over 2 ranks; Mamba-2, the router and the routed experts replicated."""
    _parity(tmp_path, "tp2", world=2, batch_per_rank=4, dp_shard=1, tp=2)


def test_tp2_olmo_world2_matches_single_process(tmp_path):
    """tiny-olmo under TP 2: QK-norm over the split projections, SwiGLU, SWA + YaRN."""
    _parity(tmp_path, "tp2_olmo", world=2, batch_per_rank=4, model=tiny_olmo(), dp_shard=1, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_shard": 2, "tp": 2}, {"dp_shard": 1, "cp": 2, "tp": 2}])
def test_tp2_olmo_world4_layouts_match_single_process(tmp_path, layout):
    """tiny-olmo under FSDP2 x TP 2 and TP 2 x CP 2."""
    name = "_".join(f"{k}{v}" for k, v in layout.items()) + "_olmo"
    _parity(tmp_path, name, world=4, batch_per_rank=2, model=tiny_olmo(), **layout)


@pytest.mark.slow
def test_fsdp2_tp2_world4_matches_single_process(tmp_path):
    """FSDP2 x TP 2: the tensor-parallel shards are FSDP-sharded over the other 2 ranks."""
    _parity(tmp_path, "fsdp2_tp2", world=4, batch_per_rank=2, dp_shard=2, tp=2)


@pytest.mark.slow
def test_tp2_with_activation_checkpointing_matches_single_process(tmp_path):
    """TP 2 with selective activation checkpointing: the recomputed forward runs the split
    Mamba-2 / attention / MLP again on the local shards."""
    train = {"activation_checkpointing": "selective"}
    _parity(tmp_path, "tp2_ac", world=2, batch_per_rank=4, train=train, dp_shard=1, tp=2)


@pytest.mark.slow
def test_tp2_cp2_world4_matches_single_process(tmp_path):
    """TP 2 x CP 2: every row split over a cp pair, every layer over a tp pair."""
    _parity(tmp_path, "tp2_cp2", world=4, batch_per_rank=4, dp_shard=1, cp=2, tp=2)


@pytest.mark.slow
def test_ep2_tp2_world4_matches_single_process(tmp_path):
    """EP 2 x TP 2: experts split over an ep pair (replicated over tp), the rest over a tp pair,
    every parameter FSDP-sharded over the dp_shard pair."""
    _parity(tmp_path, "ep2_tp2", world=4, batch_per_rank=2, dp_shard=2, ep=2, tp=2)


def test_tp2_full_format_checkpoint_resumes_in_one_process(tmp_path):
    """`train.checkpoint_format=full` under TP 2: rank 0 writes the gathered weights and AdamW
    state in canonical order (Mamba-2's rank-order rows put back), which one process resumes."""
    ref = tiny_run(tmp_path, "ref", batch_size=4, **STEPS)
    run_pretrain(ref)
    layout = ParallelConfig(dp_shard=1, tp=2)
    kw = dict(STEPS, checkpoint_format="full")
    part = tiny_run(tmp_path, "part", batch_size=4, parallel=layout, **kw)
    run_world2(tmp_path, part, until_step=2)
    cont = tiny_run(tmp_path, "part", batch_size=4, **kw)
    run_pretrain(cont, resume=True)
    worst = assert_same_losses(rows(cont.train.out_dir), rows(ref.train.out_dir), PRETRAIN_KEYS)
    weights = assert_same_weights(cont.train.out_dir, ref.train.out_dir)
    print(
        f"tp2 (full format) -> world 1: worst relative loss difference {worst:.2e}, {weights:.2e}"
    )


VOCAB_CE_WORKER = textwrap.dedent(
    """
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor
    from hybridlm.ops.cross_entropy import linear_cross_entropy_ref
    from hybridlm.train.distributed import parallel as P
    from hybridlm.train.distributed.tensor_parallel import vocab_parallel_cross_entropy

    rank, world, dev = P.init_distributed("cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64)
    W = torch.randn(24, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 24, (37,), generator=g)
    t[::5] = -100  # ignored targets
    h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
    ref = linear_cross_entropy_ref(h1, W1, t, 30)
    ref.backward()
    h2 = h.clone().requires_grad_()
    W2 = torch.nn.Parameter(distribute_tensor(W, mesh, [Shard(0)]))
    loss = vocab_parallel_cross_entropy(h2, t, 30, W2, chunk=8)  # 5 chunks
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-12, atol=0), (loss, ref)
    assert torch.allclose(h2.grad, h1.grad, rtol=1e-10, atol=1e-14)
    assert torch.allclose(W2.grad.full_tensor(), W1.grad, rtol=1e-10, atol=1e-14)
    P.destroy()
    """
)


def test_vocab_parallel_cross_entropy_equals_the_whole_vocabulary(tmp_path):
    """The vocabulary-parallel CE (fp64, 2 ranks, chunked, ignored targets, targets on both
    ranks) equals F.cross_entropy over the whole logits: loss, d/dh and the gathered d/dW."""
    launch(tmp_path, VOCAB_CE_WORKER, [], world=2)


TP_CHECK_WORKER = textwrap.dedent(
    """
    import sys
    import torch
    from hybridlm.model.model import HybridLM
    from hybridlm.train.distributed import parallel as P
    from hybridlm.train.config import RunConfig
    from hybridlm.train.distributed.tensor_parallel import apply_tensor_parallel

    rank, world, dev = P.init_distributed("cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    run = RunConfig.load(sys.argv[1])
    for overrides, want in (([], sys.argv[2]), (["model.mamba.n_groups=2"], "")):
        with torch.device("meta"):
            model = HybridLM(run.override(overrides).model_config())
        try:
            apply_tensor_parallel(model, mesh)
            got = ""
        except ValueError as err:
            got = str(err)
        assert got == want, (overrides, got)
    P.destroy()
    """
)


def test_tp2_on_the_quickstart_model_names_the_setting_to_change(tmp_path):
    """The README's tensor-parallel row on the default model (configs/quickstart.yaml, one
    Mamba-2 group): the error names model.mamba.n_groups and a value, and with that override
    every split of tp 2 is even (vocabulary, heads, groups, shared expert, experts)."""
    want = (
        "train.parallel.tp=2 must divide the model's 1 Mamba-2 groups (B / C are split with "
        "their heads): set model.mamba.n_groups to a multiple of 2 (--set "
        "model.mamba.n_groups=2; a model trained from scratch), or a train.parallel.tp that "
        "divides 1"
    )
    root = Path(__file__).resolve().parents[1]
    launch(tmp_path, TP_CHECK_WORKER, [str(root / "configs" / "quickstart.yaml"), want])


# ------------------------------------------------------------------ broken collectives
# Each parity test against a deliberately broken collective (tests/_broken.py, installed in the
# workers through the environment): the test must fail. `check` is the comparison that fails
# first: "losses" (the logged losses and gradient norms), "weights" (the final checkpoint;
# reached only when the losses pass), "exact" (the fp64 context-parallel test), None: whichever.
BROKEN = {
    "ddp_grad:0": ("ddp", None),  # rank 0 writes the checkpoint
    "ddp_grad:1": ("ddp", None),  # rank 0's weights stay right; its router bias and losses not
    "fsdp_grad:0": ("fsdp", None),
    "fsdp_grad:1": ("fsdp", None),
    "hsdp_grad:0": ("hsdp", None),  # world 4: 2 replicas x (2 shards, EP 2)
    "cp_state": ("cp2", None),
    "cp_state/exact": ("cp2_exact", "exact"),
    "ep_swap": ("ep2", "weights"),  # the losses move by 2e-7 only
    "ep_scale": ("ep2", "weights"),  # AdamW hides a gradient scale from the losses
    "tp_forward": ("tp2", None),
    "tp_backward": ("tp2", None),
}


def _run_parity(tmp_path, test: str) -> None:
    import test_train_parallel as dp

    {
        "ddp": lambda: dp.test_ddp_world2_matches_single_process(tmp_path),
        "fsdp": lambda: dp.test_fsdp2_world2_matches_single_process(tmp_path),
        "cp2": lambda: test_cp2_world2_matches_single_process(tmp_path),
        "cp2_exact": lambda: test_cp_documents_across_shards_match_single_process_exactly(
            tmp_path, 2
        ),
        "ep2": lambda: test_ep2_world2_matches_single_process(tmp_path),
        "hsdp": lambda: test_ep2_hsdp_world4_matches_single_process(tmp_path),
        "tp2": lambda: test_tp2_world2_matches_single_process(tmp_path),
    }[test]()


@pytest.mark.slow
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_collective_fails_its_parity_test(tmp_path, monkeypatch, broken):
    """The parity tests bite: each mode's test fails when one of its collectives is broken
    (`_broken.BREAKS` says how), and the run itself completes (a check fails, not the job)."""
    from _broken import BREAK

    test, check = BROKEN[broken]
    monkeypatch.setenv(BREAK, broken.split("/")[0])
    with pytest.raises(AssertionError) as err:
        _run_parity(tmp_path, test)
    text = str(err.value)
    if test == "cp2_exact":
        got = "exact" if "differ, worst" in text else "job"
    else:
        assert not text.startswith("--- rank"), text[-3000:]  # the job itself completed
        got = "weights" if text.startswith("weights:") else "losses"
    first = next((line for line in text.splitlines() if "Error: " in line), text)
    print(f"{broken} ({test}): {got} fail: {first.splitlines()[0][:200]}")
    assert check is None or got == check, (check, got, text[:500])


def test_fsdp2_bf16_parameters_with_fp32_routers():
    """`apply_fsdp2(param_dtype=bf16)` (what `train.precision: bf16` uses under FSDP2): the
    blocks compute with bf16 gathers of the fp32 shards, each router with fp32 ones; the
    gradients land in the fp32 shards; loss and gradients follow plain bf16 autocast."""
    import copy

    import torch.distributed as dist

    from _tiny import tiny_train_model
    from hybridlm import HybridLM
    from hybridlm.model.moe import TopKRouter
    from hybridlm.train.distributed.parallel import apply_fsdp2
    from hybridlm.train.objectives import causal_lm_loss

    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ref = HybridLM(tiny_train_model(), seed=0)
        model = apply_fsdp2(copy.deepcopy(ref), param_dtype=torch.bfloat16)
        seen: dict[str, torch.dtype] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, TopKRouter) or name == "layers.0.mixer.in_proj":
                mod.register_forward_pre_hook(
                    lambda m, _a, name=name: seen.__setitem__(name, m.weight.dtype)
                )
        ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
        losses = []
        for m in (ref, model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = causal_lm_loss(m, m(ids, mtp_depth=m.train_mtp_depth), ids)[0]
            loss.backward()
            losses.append(float(loss.detach()))
        assert seen.pop("layers.0.mixer.in_proj") == torch.bfloat16
        assert seen and set(seen.values()) == {torch.float32}, seen  # every router
        assert abs(losses[1] - losses[0]) <= 1e-2 * losses[0], losses
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            g, want = p.grad.full_tensor(), q.grad
            rel = float((g - want).norm() / want.norm().clamp(min=1e-12))
            assert rel < 0.05, (name, rel)
    finally:
        dist.destroy_process_group()
