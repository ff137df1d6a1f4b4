"""Chunked all-to-all overlap (AllToAllDispatcher with overlap and chunks > 1) computes what the
synchronous, unchunked dispatch computes.

Every token copy meets the same expert arithmetic in its chunk as in one piece, so the layer's
outputs, its input gradients and every gradient reached through them (router, shared expert) are
bit-equal; the routed experts' weight gradients are sums over the chunks instead of one sum, so
they are equal up to the fp32 rounding of that order (1e-5 relative, 1e-6 of the largest element). Layer level: EP 2
and EP 4 on 4 gloo ranks, chunk counts that divide nothing, and chunks carrying no copies to some
rank. Model level: the expert-parallel layouts of test_parallel (EP alone, EP with FSDP and TP,
HSDP with EP and TP), overlap on and off, the same losses over a few optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh

from supernode.core.config import Parallel
from supernode.trainer.dispatcher import AllToAllDispatcher
from supernode.trainer.model import loss_fn
from supernode.trainer.moe import ExpertBalancer, MoE
from supernode.trainer.parallel import Meshes, build_model

DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 8, 2
IDLE = 5  # biased out of every top-k: no copies in any chunk
CHUNKS = (2, 3, 4, 16)  # 3 divides no rank's copies evenly; 16 leaves chunks with nothing for some rank
ROWS = (5, 12, 1, 9)  # tokens per rank, uneven


def make_moe() -> MoE:
    layer = MoE(DIM, EXPERTS, TOP_K, HIDDEN, shared_experts=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        layer.router.bias[IDLE] = -100.0
    return layer


def run_layer(rank: int, world_size: int) -> dict:
    x = torch.randn(ROWS[rank], DIM, generator=torch.Generator().manual_seed(10 + rank))
    upstream = torch.randn(ROWS[rank], DIM, generator=torch.Generator().manual_seed(20 + rank))
    results = {}
    for ep in (4, 2):
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
        per, ep_rank = EXPERTS // ep, mesh["ep"].get_local_rank()
        for overlap, chunks in ((False, 1), *((True, k) for k in (1, *CHUNKS))):
            layer = make_moe()
            for name in ("w1", "w2", "w3"):  # this rank keeps its experts only
                full = getattr(layer.experts, name).detach()
                setattr(layer.experts, name, torch.nn.Parameter(full[ep_rank * per : (ep_rank + 1) * per].clone()))
            layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), overlap=overlap, chunks=chunks)
            xg = x.clone().requires_grad_()
            out = layer(xg)
            (out * upstream).sum().backward()
            results[(ep, overlap, chunks)] = {
                "out": out.detach(),
                "dx": xg.grad,
                "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
                "counts": layer.tokens_per_expert.clone(),
            }
    return results


@pytest.mark.slow
def test_chunked_dispatch_equals_the_synchronous_one_at_ep_2_and_4(tmp_path) -> None:

    ranks = spawn(run_layer, 4, tmp_path)
    for ep in (4, 2):
        for overlap, chunks in ((True, 1), *((True, k) for k in CHUNKS)):
            label = f"ep={ep} chunks={chunks}"
            for rank, got in enumerate(ranks):
                ref, run = got[(ep, False, 1)], got[(ep, overlap, chunks)]
                assert torch.equal(run["out"], ref["out"]), f"{label} rank {rank}: outputs differ"
                assert torch.equal(run["dx"], ref["dx"]), f"{label} rank {rank}: input gradients differ"
                for name, g in ref["grads"].items():
                    if name.startswith("experts."):  # K partial sums over the copies instead of one
                        # (an element that cancels to ~0 keeps the absolute error of its larger terms)
                        torch.testing.assert_close(
                            run["grads"][name],
                            g,
                            rtol=1e-5,
                            atol=1e-6 * g.abs().max().item(),
                            msg=lambda m: f"{label} {name}: {m}",
                        )
                    else:
                        assert torch.equal(run["grads"][name], g), f"{label} rank {rank} {name} differs"
    # The cases the chunking must survive happened: copies per (rank, expert) that 3 does not divide,
    # a rank that sends an EP rank nothing at all, and at 16 chunks, between ranks that do exchange
    # copies, chunks that carry none.
    counts = torch.stack([r[(4, False, 1)]["counts"] for r in ranks])  # [rank, expert]
    assert counts[:, IDLE].sum() == 0
    assert (counts[:, counts.sum(0) > 0] % 3 != 0).any()
    per_rank_pair = counts.view(4, 4, EXPERTS // 4).sum(2)  # copies rank i sends to EP rank j
    assert (per_rank_pair == 0).any() and ((per_rank_pair > 0) & (per_rank_pair < 16)).any()


def test_chunks_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="chunks must be at least 1, got 0"):
        AllToAllDispatcher(None, chunks=0)  # type: ignore[arg-type]


# -- the whole model, a few optimizer steps -----------------------------------------------------

# name: (dp_replicate, dp_shard, tp, ep, activation checkpointing)
LAYOUTS = {
    "ep4": (1, 4, 1, 4, "none"),
    "ep2_fsdp_tp": (1, 2, 2, 2, "selective"),
    "hsdp_ep2_tp": (2, 1, 2, 2, "full"),
}
STEPS = 3


def run_model(rank: int, world_size: int) -> dict:
    from test_parallel import MODEL, SEED, _full, batch  # the layouts' harness: same model and batch

    results = {}
    for name, (dpr, dps, tp, ep, ac) in LAYOUTS.items():
        for overlap, chunks in ((False, 1), (True, 3)):
            parallel = Parallel(
                dp_replicate=dpr,
                dp_shard=dps,
                tp=tp,
                ep=ep,
                activation_checkpointing=ac,
                overlap=overlap,
                all_to_all_chunks=chunks,
            )
            mesh = Meshes.build(parallel, "cpu")
            model = build_model(MODEL, parallel, torch.device("cpu"), SEED, mesh)
            dispatchers = {type(m.dispatcher) for m in model.moe_layers()}
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ExpertBalancer(model.moe_layers(), MODEL.bias_update_rate).attach(opt)
            tokens = batch().chunk(parallel.dp)[parallel.dp_rank(rank)]
            losses, grads = [], []
            for _ in range(STEPS):
                opt.zero_grad()
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) + model.aux_loss()
                loss.backward()
                losses.append(loss.item())
                grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
                opt.step()
            results[(name, overlap)] = {"losses": losses, "grads": grads, "dispatchers": dispatchers}
            assert all(m.dispatcher.chunks == chunks for m in model.moe_layers())
    return results


@pytest.mark.slow
def test_overlap_on_and_off_train_alike_at_every_expert_parallel_layout(tmp_path) -> None:

    ranks = spawn(run_model, 4, tmp_path)
    for rank, got in enumerate(ranks):
        for name in LAYOUTS:
            on, off = got[(name, True)], got[(name, False)]
            assert on["dispatchers"] == off["dispatchers"] == {AllToAllDispatcher}
            # Bit-equal losses at the first step; after it only the experts' gradient rounding
            # (see the module docstring) can separate the runs.
            assert on["losses"][0] == off["losses"][0], f"{name} rank {rank}"
            assert on["losses"] == pytest.approx(off["losses"], rel=1e-6, abs=1e-7), f"{name} rank {rank}"
            for step, (g_on, g_off) in enumerate(zip(on["grads"], off["grads"])):
                for param, g in g_off.items():
                    torch.testing.assert_close(
                        g_on[param], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} step {step} {param}: {m}"
                    )
