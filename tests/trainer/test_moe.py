"""MoE layer: grouped_mm equals the per-expert loop; expert-parallel dispatch/combine is exact."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from trainer.dispatcher import AllToAllDispatcher
from trainer.moe import ExpertBalancer, MoE, expert_ffn, grouped_mm_applies

DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 4, 2
EMPTY = 3  # this expert is biased out of every top-k: it gets no tokens


def make_moe(seed: int = 0, shared: int = 1, dtype: torch.dtype = torch.float32) -> MoE:
    layer = MoE(DIM, EXPERTS, TOP_K, HIDDEN, shared_experts=shared)
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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, {}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})])
def test_grouped_mm_equals_loop_values_and_grads(dtype: torch.dtype, tol: dict) -> None:
    layer, x = make_moe(dtype=dtype), rows(37, dtype=dtype)
    upstream = torch.randn(37, DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert grouped_mm_applies(x, layer.experts.w1)
    with mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm) as spy:
        out_g, dx_g, grads_g = fwd_bwd(layer, x, upstream)
    assert spy.call_count == 3, "the grouped path must actually run"
    assert layer.tokens_per_expert[EMPTY] == 0 and layer.tokens_per_expert.sum() == 37 * TOP_K
    layer.experts.use_grouped_mm = False
    out_l, dx_l, grads_l = fwd_bwd(layer, x, upstream)
    torch.testing.assert_close(out_g, out_l, **tol)
    torch.testing.assert_close(dx_g, dx_l, **tol)
    for name in grads_l:
        torch.testing.assert_close(grads_g[name], grads_l[name], **tol, msg=lambda m: f"{name}: {m}")
    assert grads_g["experts.w1"][EMPTY].abs().sum() == 0  # an idle expert gets a zero gradient


def per_token_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's function written token by token: sum_k w_k * SwiGLU_{e_k}(x_t), plus the shared expert."""
    weights, ids, _, _ = layer.router(x)
    ex, f = layer.experts, torch.nn.functional
    out = []
    for t in range(x.shape[0]):
        y = sum(weights[t, j] * ((f.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])) @ ex.w2[e])
                for j, e in enumerate(ids[t].tolist()))
        out.append(y + layer.shared(x[t:t + 1])[0] if layer.shared is not None else y)
    return torch.stack(out)


@pytest.mark.parametrize("grouped", [None, False])
def test_layer_equals_the_per_token_reference_values_and_grads(grouped) -> None:
    # The token permutation (gather by expert, weighted scatter back) against a formulation without one.
    layer, x = make_moe(), rows(23)
    layer.experts.use_grouped_mm = grouped
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


def test_expert_ffn_is_swiglu_per_expert() -> None:
    x, counts = rows(7), torch.tensor([2, 0, 5])
    w1, w3 = torch.randn(3, DIM, HIDDEN), torch.randn(3, DIM, HIDDEN)
    w2 = torch.randn(3, HIDDEN, DIM)
    expected = torch.cat([(torch.nn.functional.silu(x[:2] @ w1[0]) * (x[:2] @ w3[0])) @ w2[0],
                          (torch.nn.functional.silu(x[2:] @ w1[2]) * (x[2:] @ w3[2])) @ w2[2]])
    torch.testing.assert_close(expert_ffn(x, counts, w1, w2, w3), expected, rtol=1e-5, atol=1e-5)


def test_unaligned_rows_fall_back_to_the_loop() -> None:
    # 6 fp32 columns = 24-byte rows: grouped_mm would reject them (16-byte strides).
    x, w = torch.randn(5, 6), torch.randn(2, 6, 8)
    assert not grouped_mm_applies(x, w)
    assert not grouped_mm_applies(torch.randn(0, 8), torch.randn(2, 8, 8))  # no rows at all
    out = expert_ffn(x, torch.tensor([3, 2]), w, torch.randn(2, 8, 6), w.clone())
    assert out.shape == (5, 6)


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
                setattr(layer.experts, name, torch.nn.Parameter(full.detach()[ep_rank * per:(ep_rank + 1) * per].clone()))
            layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), overlap=overlap)
            out, dx, grads = fwd_bwd(layer, rows(TOTAL)[rank_rows(rank)], upstream(TOTAL)[rank_rows(rank)])
            results[(ep, overlap)] = {"out": out, "dx": dx, "grads": grads, "ep_rank": ep_rank,
                                      "load": ExpertBalancer([layer], 0.0).reduce()[0]}  # summed over the ranks
    return results


def upstream(n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(5))


@pytest.mark.slow
def test_dispatch_combine_exact_for_uneven_counts_and_an_idle_expert(tmp_path) -> None:
    from conftest import spawn

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

    from bench.moe import main

    assert main(["--tokens", "256", "--dim", "32", "--hidden", "64", "--experts", "4", "--topk", "2",
                 "--threads", "1", "--repeat", "1", "--ep", "2"]) == 0
    layer, a2a = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert layer["measurement"] == "moe_layer_fwd_bwd" and layer["grouped_mm_used"] is True
    assert layer["grouped_mm_tokens_per_s"] > 0 and layer["naive_loop_tokens_per_s"] > 0
    assert layer["grouped_mm_gflop_per_s"] > 0
    assert a2a["ratio_vs_routing_minimum"] == pytest.approx(1.0, abs=1e-3)  # only the counts are extra
    assert a2a["ratio_vs_analytic"] < 1.3  # routing of 512 copies is only roughly uniform


def test_bench_moe_bad_flags_exit_2(capsys) -> None:
    from bench.moe import main

    with pytest.raises(SystemExit) as exc:
        main(["--topk", "9", "--experts", "8"])
    assert exc.value.code == 2
    assert "--topk must be at most --experts (8) (got 9)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_bench_without_cuda_says_so(capsys) -> None:
    import json

    from bench.gpu_moe import main

    assert main([]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["skipped"] is True and "CUDA is not available" in line["reason"]
