"""MoE layer: every expert strategy (padded, grouped_mm) equals the per-expert loop; expert-parallel
dispatch/combine is exact."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh

from supernode.trainer.dispatcher import AllToAllDispatcher
from supernode.trainer.moe import (
    BLOCK_WASTE,
    PAD_ROWS,
    ExpertBalancer,
    MoE,
    _BufferPool,
    expert_blocks,
    expert_ffn,
    expert_strategy,
    grouped_mm_applies,
)

DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 4, 2
EMPTY = 3  # this expert is biased out of every top-k: it gets no tokens


def make_moe(seed: int = 0, shared: int = 1, dtype: torch.dtype = torch.float32, top_k: int = TOP_K) -> MoE:
    layer = MoE(DIM, EXPERTS, top_k, HIDDEN, shared_experts=shared)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        layer.router.bias[EMPTY] = -100.0
    return layer.to(dtype)


def rows(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fwd_bwd(layer: MoE, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("strategy", ["padded", "grouped"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, {}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})])
def test_each_strategy_equals_the_loop_values_and_grads(strategy: str, dtype: torch.dtype, tol: dict) -> None:
    layer, x = make_moe(dtype=dtype), rows(37, dtype=dtype)
    upstream = torch.randn(37, DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert expert_strategy(x, layer.experts.w1) == "padded"  # the CPU default
    layer.experts.strategy = strategy
    with (
        mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm) as grouped,
        mock.patch.object(torch, "bmm", wraps=torch.bmm) as batched,
    ):
        out_s, dx_s, grads_s = fwd_bwd(layer, x, upstream)
    # The path asked for actually ran: 3 grouped matmuls, or 3 batched ones per block and 6 back.
    assert (grouped.call_count, batched.call_count > 0) == ((3, False) if strategy == "grouped" else (0, True))
    assert layer.tokens_per_expert[EMPTY] == 0 and layer.tokens_per_expert.sum() == 37 * TOP_K
    layer.experts.strategy = "loop"
    out_l, dx_l, grads_l = fwd_bwd(layer, x, upstream)
    torch.testing.assert_close(out_s, out_l, **tol)
    torch.testing.assert_close(dx_s, dx_l, **tol)
    for name in grads_l:
        torch.testing.assert_close(grads_s[name], grads_l[name], **tol, msg=lambda m: f"{name}: {m}")
    assert grads_s["experts.w1"][EMPTY].abs().sum() == 0  # an idle expert gets a zero gradient


def test_expert_blocks_pad_little_and_cover_every_expert() -> None:
    sizes = [206, 373, 324, 279, 0, 245, 237, 5000, 172, 241, 1, 271, 203]
    blocks = expert_blocks(sizes)
    assert [e for s, _ in blocks for e in range(s.start, s.stop)] == list(range(len(sizes)))
    for s, rows in blocks:
        assert rows % PAD_ROWS == 0 and rows >= max(sizes[s])
        if s.stop - s.start > 1:  # a block of several experts stays little padded
            assert (s.stop - s.start) * rows <= BLOCK_WASTE * sum(sizes[s])
    assert (slice(7, 8), 5024) in blocks  # an expert far larger than its neighbours is a block alone
    assert expert_blocks([0, 0]) == [(slice(0, 2), 0)]  # idle experts cost nothing


def test_padded_path_is_exact_for_skewed_empty_and_large_experts() -> None:
    # Counts that make blocks of one, several and an empty expert; more rows than one block holds.
    sizes = [0, 700, 3, 5000, 0, 64, 65]
    x = torch.randn(sum(sizes), DIM, generator=torch.Generator().manual_seed(4), requires_grad=True)
    weights = [
        torch.randn(len(sizes), *shape, generator=torch.Generator().manual_seed(5 + i)).mul_(0.2).requires_grad_()
        for i, shape in enumerate([(DIM, HIDDEN), (HIDDEN, DIM), (DIM, HIDDEN)])
    ]
    upstream = torch.randn(sum(sizes), DIM, generator=torch.Generator().manual_seed(9))
    results = {}
    for strategy in ("padded", "loop"):
        for t in [x, *weights]:
            t.grad = None
        out = expert_ffn(x, torch.tensor(sizes), *weights, strategy=strategy)
        out.backward(upstream, retain_graph=True)
        first = [t.grad.clone() for t in [x, *weights]]
        for t in [x, *weights]:
            t.grad = None
        # A second backward through the same graph gives the same gradients, even after another
        # forward: retained activations are not handed back to the pool to be overwritten.
        expert_ffn(x.detach() * 3, torch.tensor(sizes), *(w.detach() for w in weights), strategy=strategy)
        out.backward(upstream)
        assert all(torch.equal(g, t.grad) for g, t in zip(first, [x, *weights]))
        results[strategy] = (out.detach(), first)
    torch.testing.assert_close(results["padded"][0], results["loop"][0], rtol=1e-5, atol=1e-5)
    for padded, loop in zip(results["padded"][1], results["loop"][1]):
        torch.testing.assert_close(padded, loop, rtol=1e-4, atol=1e-4)
    assert results["padded"][1][1][0].abs().sum() == 0 and results["padded"][1][1][4].abs().sum() == 0


def per_token_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's function written token by token: sum_k w_k * SwiGLU_{e_k}(x_t), plus the shared expert."""
    weights, ids, _, _ = layer.router(x)
    ex, f = layer.experts, torch.nn.functional
    out = []
    for t in range(x.shape[0]):
        y = sum(
            weights[t, j] * ((f.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])) @ ex.w2[e])
            for j, e in enumerate(ids[t].tolist())
        )
        out.append(y + layer.shared(x[t : t + 1])[0] if layer.shared is not None else y)
    return torch.stack(out)


@pytest.mark.parametrize("strategy, top_k", [(None, 2), ("grouped", 2), ("loop", 2), (None, 1), (None, 3)])
def test_layer_equals_the_per_token_reference_values_and_grads(strategy, top_k) -> None:
    # The token permutation (gather by expert, gate-weighted sum back) against a formulation without one.
    layer, x = make_moe(top_k=top_k), rows(23)
    layer.experts.strategy = strategy
    upstream = torch.randn(23, DIM, generator=torch.Generator().manual_seed(3))
    out, dx, grads = fwd_bwd(layer, x, upstream)
    ref_x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    ref = per_token_reference(layer, ref_x)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(dx, ref_x.grad)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


def test_buffer_pool_lends_a_buffer_to_one_taker_at_a_time() -> None:
    pool, like = _BufferPool(), torch.zeros(1)
    a = pool.take(like, 4, 8)
    b = pool.take(like, 4, 8)
    assert a.shape == (4, 8) and a.data_ptr() != b.data_ptr()
    pool.give(a)
    pool.give(a)  # twice: ignored, or two takers would share it
    pool.give(torch.empty(4, 8))  # not lent: ignored
    c, d = pool.take(like, 3, 10), pool.take(like, 4, 8)
    assert c.data_ptr() == a.data_ptr() and d.data_ptr() not in (a.data_ptr(), b.data_ptr())
    pool.give(c)
    assert pool.take(like, 1000).data_ptr() != c.data_ptr()  # too small a buffer serves no one
    assert pool.take(like, 2).data_ptr() != c.data_ptr()  # nor one over twice the size asked


def test_padded_experts_reuse_their_memory_and_survive_checkpointing(monkeypatch) -> None:
    from torch.utils.checkpoint import checkpoint

    from supernode.trainer import moe

    sizes = torch.tensor([300, 0, 41, 97])
    x = torch.randn(int(sizes.sum()), DIM, generator=torch.Generator().manual_seed(4), requires_grad=True)
    weights = [
        torch.randn(4, *shape, generator=torch.Generator().manual_seed(5 + i)).mul_(0.2).requires_grad_()
        for i, shape in enumerate([(DIM, HIDDEN), (HIDDEN, DIM), (DIM, HIDDEN)])
    ]
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    pool = moe._BufferPool()
    monkeypatch.setattr(moe, "_POOL", pool)

    def step(checkpointed: bool) -> list[torch.Tensor]:
        for t in [x, *weights]:
            t.grad = None
        if checkpointed:
            out = checkpoint(expert_ffn, x, sizes, *weights, use_reentrant=False)
        else:
            out = expert_ffn(x, sizes, *weights)
        out.backward(upstream)
        return [t.grad for t in [x, *weights]]

    def buffers() -> dict[int, int]:
        return {id(b): b.numel() for free in pool._free.values() for b in free}

    reference = step(False)
    after_one = buffers()
    assert after_one and not pool._lent  # everything lent came back at the end of backward
    grads = step(False)
    assert buffers() == after_one, "a step re-uses the memory of the last one, nothing more"
    # Checkpointed, the forward's activations are dropped, not given back; the recomputation in
    # backward takes new ones and gives them back: the pool keeps the same sizes, no more.
    grads_checkpointed = step(True)
    assert sorted(buffers().values()) == sorted(after_one.values()) and not pool._lent
    for got in (grads, grads_checkpointed):
        for g, ref in zip(got, reference):
            torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_expert_ffn_is_swiglu_per_expert() -> None:
    x, counts = rows(7), torch.tensor([2, 0, 5])
    w1, w3 = torch.randn(3, DIM, HIDDEN), torch.randn(3, DIM, HIDDEN)
    w2 = torch.randn(3, HIDDEN, DIM)
    expected = torch.cat(
        [
            (torch.nn.functional.silu(x[:2] @ w1[0]) * (x[:2] @ w3[0])) @ w2[0],
            (torch.nn.functional.silu(x[2:] @ w1[2]) * (x[2:] @ w3[2])) @ w2[2],
        ]
    )
    torch.testing.assert_close(expert_ffn(x, counts, w1, w2, w3), expected, rtol=1e-5, atol=1e-5)


def test_unaligned_rows_are_fine_on_cpu_and_refused_by_grouped_mm() -> None:
    # 6 fp32 columns = 24-byte rows: grouped_mm would reject them (16-byte strides); the padded path
    # (the CPU default) and the loop take any shape.
    x, w, w2 = torch.randn(5, 6), torch.randn(2, 6, 8), torch.randn(2, 8, 6)
    assert not grouped_mm_applies(x, w)
    assert not grouped_mm_applies(torch.randn(0, 8), torch.randn(2, 8, 8))  # no rows at all
    counts = torch.tensor([3, 2])
    torch.testing.assert_close(expert_ffn(x, counts, w, w2, w.clone()), expert_ffn(x, counts, w, w2, w.clone(), "loop"))
    with pytest.raises(ValueError, match="padded, grouped or loop, got 'fused'"):
        expert_ffn(x, counts, w, w2, w.clone(), "fused")


def test_sigmoid_router_weights_sum_to_one() -> None:
    layer = MoE(DIM, EXPERTS, TOP_K, HIDDEN, score="sigmoid")
    weights, ids, _, scores = layer.router(rows(9))
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    assert ids.shape == (9, TOP_K)
    with pytest.raises(ValueError, match="softmax or sigmoid, got 'relu'"):
        MoE(DIM, EXPERTS, TOP_K, HIDDEN, score="relu")


# -- expert parallel ----------------------------------------------------------------------------


def rank_rows(rank: int) -> slice:
    """Uneven token counts per rank: 5, 8, 11, 14."""
    start = sum(5 + 3 * r for r in range(rank))
    return slice(start, start + 5 + 3 * rank)


TOTAL = rank_rows(3).stop


def run_ep(rank: int, world_size: int) -> dict:
    results = {}
    for ep in (4, 2):
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
        ep_rank = mesh["ep"].get_local_rank()
        for overlap in (True, False):
            layer = make_moe()
            per = EXPERTS // ep
            for name in ("w1", "w2", "w3"):  # this rank keeps its experts only
                full = getattr(layer.experts, name)
                setattr(
                    layer.experts, name, torch.nn.Parameter(full.detach()[ep_rank * per : (ep_rank + 1) * per].clone())
                )
            layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), overlap=overlap)
            out, dx, grads = fwd_bwd(layer, rows(TOTAL)[rank_rows(rank)], upstream(TOTAL)[rank_rows(rank)])
            results[(ep, overlap)] = {
                "out": out,
                "dx": dx,
                "grads": grads,
                "ep_rank": ep_rank,
                "load": ExpertBalancer([layer], 0.0).reduce()[0],
            }  # summed over the ranks
    return results


def upstream(n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(5))


@pytest.mark.slow
def test_dispatch_combine_exact_for_uneven_counts_and_an_idle_expert(tmp_path) -> None:

    ranks = spawn(run_ep, 4, tmp_path)
    ref = make_moe()
    out, dx, grads = fwd_bwd(ref, rows(TOTAL), upstream(TOTAL))
    assert ref.tokens_per_expert[EMPTY] == 0 and len(set(ref.tokens_per_expert[:EMPTY].tolist())) > 1
    for ep in (4, 2):
        for overlap in (True, False):
            got = [r[(ep, overlap)] for r in ranks]
            label = f"ep={ep} overlap={overlap}"
            torch.testing.assert_close(torch.cat([g["out"] for g in got]), out, msg=lambda m: f"{label} out: {m}")
            torch.testing.assert_close(torch.cat([g["dx"] for g in got]), dx, msg=lambda m: f"{label} dx: {m}")
            for g in got:
                assert torch.equal(g["load"], ref.tokens_per_expert), "global token counts"
            for name, ref_grad in grads.items():
                if name.startswith("experts."):  # sum the replicas of each expert slice, then stack the slices
                    slices = [sum(g["grads"][name] for g in got if g["ep_rank"] == e) for e in range(ep)]
                    grad = torch.cat(slices)
                else:
                    grad = sum(g["grads"][name] for g in got)
                torch.testing.assert_close(grad, ref_grad, msg=lambda m: f"{label} {name}: {m}")


# -- the benchmarks built on this layer -----------------------------------------------------------


@pytest.mark.slow
def test_bench_moe_reports_both_paths_and_minimal_all_to_all_bytes(capsys) -> None:
    import json

    from supernode.bench.moe import main

    assert (
        main(
            [
                "--tokens",
                "256",
                "--dim",
                "32",
                "--hidden",
                "64",
                "--experts",
                "4",
                "--topk",
                "2",
                "--threads",
                "1",
                "--repeat",
                "1",
                "--ep",
                "2",
            ]
        )
        == 0
    )
    layer, a2a = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert layer["measurement"] == "moe_layer_fwd_bwd" and layer["expert_strategy"] == "padded"
    assert layer["layer_tokens_per_s"] > 0 and layer["naive_loop_tokens_per_s"] > 0
    assert layer["layer_gflop_per_s"] > 0
    assert a2a["ratio_vs_routing_minimum"] == pytest.approx(1.0, abs=1e-3)  # only the counts are extra
    assert a2a["ratio_vs_analytic"] < 1.3  # routing of 512 copies is only roughly uniform


def test_bench_moe_bad_flags_exit_2(capsys) -> None:
    from supernode.bench.moe import main

    with pytest.raises(SystemExit) as exc:
        main(["--topk", "9", "--experts", "8"])
    assert exc.value.code == 2
    assert "--topk must be at most --experts (8) (got 9)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_bench_without_cuda_says_so(capsys) -> None:
    import json

    from supernode.bench.gpu_moe import main

    assert main([]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["skipped"] is True and "CUDA is not available" in line["reason"]
