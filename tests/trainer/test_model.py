"""The one-device model: determinism, router semantics, auxiliary losses, checkpointing modes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from supernode.core.config import Model
from supernode.trainer.model import Transformer, apply_rope, loss_fn, rope_tables
from supernode.trainer.moe import ExpertBalancer

CFG = Model(
    layers=3,
    dim=32,
    heads=4,
    kv_heads=2,
    experts=4,
    top_k=2,
    shared_experts=1,
    expert_hidden=16,
    dense_hidden=48,
    first_dense_layers=1,
    vocab=64,
    seq_len=16,
    load_balance_coef=0.01,
    z_loss_coef=0.001,
)


def tokens(seed: int = 0, batch: int = 2, cfg: Model = CFG) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def step(model: Transformer, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1])
    loss = loss_fn(logits, batch[:, 1:]) + model.aux_loss()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def build(cfg: Model = CFG, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def test_forward_backward_deterministic_for_a_seed() -> None:
    batch = tokens()
    logits_a, grads_a = step(build(seed=3), batch)
    logits_b, grads_b = step(build(seed=3), batch)
    assert logits_a.shape == (2, CFG.seq_len, CFG.vocab)
    assert torch.equal(logits_a, logits_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(g.abs().sum() > 0 for g in grads_a.values()), "every parameter must receive a gradient"
    logits_c, _ = step(build(seed=4), batch)
    assert not torch.allclose(logits_a, logits_c)


def test_layer_kinds_follow_config() -> None:
    cfg = CFG.model_copy(update={"layers": 5, "first_dense_layers": 1, "moe_every": 2})
    model = build(cfg)
    assert [b.moe for b in model.layers] == [False, True, False, True, False]
    assert ExpertBalancer(model.moe_layers(), cfg.bias_update_rate).reduce().shape == (2, cfg.experts)


def test_causal() -> None:
    model = build()
    batch = tokens()[:, :-1]
    changed = batch.clone()
    changed[:, -1] = (changed[:, -1] + 1) % CFG.vocab
    with torch.no_grad():
        a, b = model(batch), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_rope_rotates_pairs_by_position() -> None:
    cos, sin = rope_tables(4, 2, theta=10000.0)
    x = torch.tensor([1.0, 0.0]).expand(1, 4, 1, 2)
    out = apply_rope(x, cos, sin)[0, :, 0]
    angles = torch.arange(4.0)
    torch.testing.assert_close(out, torch.stack([angles.cos(), angles.sin()], -1))


def test_loss_fn_is_mean_cross_entropy() -> None:
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(loss_fn(logits, targets), F.cross_entropy(logits.reshape(6, 5), targets.reshape(6)))


def test_aux_loss_weights_and_terms() -> None:
    model = build(CFG.model_copy(update={"load_balance_coef": 0.0, "z_loss_coef": 0.0}))
    model(tokens()[:, :-1])
    assert model.aux_loss().item() == 0.0
    model = build()
    x = tokens()[:, :-1]
    model(x)
    moe = model.moe_layers()[0]
    expected = sum(CFG.load_balance_coef * m.load_balance_loss + CFG.z_loss_coef * m.z_loss for m in model.moe_layers())
    torch.testing.assert_close(model.aux_loss(), expected)
    # Perfectly balanced routing gives a load-balance loss of ~1 (E * sum(1/E * 1/E) * E); it is >= 1.
    assert moe.load_balance_loss.item() >= 0.99
    assert ExpertBalancer(model.moe_layers(), 0.0).reduce().sum(1).tolist() == [x.numel() * CFG.top_k] * CFG.moe_layers


def test_router_bias_changes_selection_not_gate_weights() -> None:
    model = build()
    router = model.moe_layers()[0].router
    rows = torch.randn(20, CFG.dim)
    weights, ids, _, scores = router(rows)
    router.bias[0] = 10.0  # forces expert 0 into every token's top-k
    weights_b, ids_b, _, scores_b = router(rows)
    assert torch.equal(scores, scores_b)
    assert (ids_b == 0).any(-1).all()
    picked = scores.gather(-1, ids_b)
    torch.testing.assert_close(weights_b, picked / picked.sum(-1, keepdim=True))


def test_balancer_moves_router_bias_toward_balance_at_the_optimizer_step() -> None:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    balancer = ExpertBalancer(model.moe_layers(), CFG.bias_update_rate)
    balancer.attach(opt)
    model(tokens()[:, :-1])
    model(tokens(seed=1)[:, :-1])  # two micro-batches: their counts add up on the device
    load = ExpertBalancer(model.moe_layers(), 0.0).reduce()
    model(tokens()[:, :-1])
    model(tokens(seed=1)[:, :-1])
    opt.step()  # the pre-hook reduces the step's counts and moves the biases
    assert torch.equal(balancer.last_load, load) and load.sum(1).tolist() == [2 * 2 * CFG.seq_len * CFG.top_k] * 2
    bias = model.moe_layers()[0].router.bias
    expected = CFG.bias_update_rate * torch.sign(load[0].float().mean() - load[0].float())
    torch.testing.assert_close(bias, expected)
    assert bias[load[0].argmax()] < 0 < bias[load[0].argmin()]
    assert all(m.tokens_per_expert.sum() == 0 for m in model.moe_layers()), "a step starts counting afresh"
    # A given load can be passed instead; a wrong shape is a clear error.
    balancer.step(torch.tensor([[1, 9, 5, 5]] * CFG.moe_layers))
    torch.testing.assert_close(bias, expected + CFG.bias_update_rate * torch.tensor([1.0, -1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"load must have shape \(2, 4\), got \(4,\)"):
        balancer.step(torch.ones(4))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_does_not_count_tokens_twice(mode: str) -> None:
    model = build()
    for block in model.layers:
        block.checkpoint = mode
    batch = tokens()
    (loss_fn(model(batch[:, :-1]), batch[:, 1:]) + model.aux_loss()).backward()  # backward recomputes the MoE
    load = ExpertBalancer(model.moe_layers(), 0.0).reduce()
    assert load.sum(1).tolist() == [batch[:, :-1].numel() * CFG.top_k] * CFG.moe_layers


def test_balance_groups_average_the_loss_over_groups_of_rows() -> None:
    model = build()
    moe = model.moe_layers()[0]
    rows = torch.randn(12, CFG.dim)
    parts = []
    for part in rows.chunk(3):  # what three ranks routing 4 rows each compute
        moe(part)
        parts.append(moe.load_balance_loss)
    moe.balance_groups = 3
    moe(rows)
    torch.testing.assert_close(moe.load_balance_loss, sum(parts) / 3)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_same_gradients(mode: str) -> None:
    batch = tokens()
    logits_ref, grads_ref = step(build(), batch)
    model = build()
    for block in model.layers:
        block.checkpoint = mode
    logits, grads = step(model, batch)
    torch.testing.assert_close(logits, logits_ref)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, msg=lambda m: f"{name}: {m}")


def test_tied_embeddings_share_one_parameter() -> None:
    model = build(CFG.model_copy(update={"tie_embeddings": True}))
    assert model.output.weight is model.embed.weight
    _, grads = step(model, tokens())
    assert "output.weight" not in grads  # named_parameters lists the shared tensor once


def test_sequence_longer_than_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="exceeds model.seqLen 16"):
        build()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("cfg", [CFG, CFG.model_copy(update={"tie_embeddings": True})])
def test_meta_device_build_then_init_weights_is_complete(cfg: Model) -> None:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    if cfg.tie_embeddings:
        assert model.output.weight is model.embed.weight
    batch = tokens()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(model(batch), build(cfg)(batch), rtol=0, atol=0)
