"""Import (`training.initFrom`, `supernode import`): a Hugging Face directory -> the sharded model at step 0.

The round trip: a checkpoint is exported, loaded into fresh sharded models at three layouts (ep 2,
ep 1 x dp 2, tp 2) on two gloo ranks, and step 0's loss there equals `transformers`' loss of the
exported model on the same batch; the model loaded at ep 1 x dp 2 is saved and exported again, bit
for bit the first export. Tolerance of the loss: 1e-4 absolute at fp32 (the two forwards differ only
in summation order, test_export bounds their logits by 1e-4; a wrong mapping — RoPE halves left in,
a transposed expert, a missing selection bias — moves the loss by more than 0.01).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from ranks import spawn

from supernode.cli import main as cli
from supernode.core.checkpoints import COMPLETE, complete_checkpoints
from supernode.core.config import Model, Parallel
from supernode.core.errors import BadInput
from supernode.core.files import sha256_file
from supernode.core.pretrained import MANIFEST, compare, write_manifest
from supernode.core.runs import checkpoints_of, run_of
from supernode.trainer.hf.export import export
from supernode.trainer.hf.load import load_pretrained
from supernode.trainer.model import Transformer, loss_fn
from supernode.trainer.parallel import Meshes, build_model

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GLM = Model(
    layers=3,
    dim=128,
    heads=4,
    kv_heads=2,  # tp 2 splits the kv heads
    experts=4,
    top_k=2,
    shared_experts=1,
    expert_hidden=64,
    dense_hidden=192,
    first_dense_layers=1,
    vocab=96,
    seq_len=32,
    router="sigmoid",
    rope_theta=500.0,
)
LAYOUTS = {
    "ep2": Parallel(dp_shard=2, ep=2, mixed_precision="fp32"),
    "ep1_dp2": Parallel(dp_shard=2, ep=1, mixed_precision="fp32"),
    "tp2": Parallel(dp_shard=1, tp=2, ep=1, mixed_precision="fp32"),
}


def _batch(m: Model) -> torch.Tensor:
    return torch.randint(0, m.vocab, (4, m.seq_len + 1), generator=torch.Generator().manual_seed(3))


def _trained_checkpoint(tmp: Path, m: Model) -> Path:
    """A committed checkpoint whose every tensor is non-trivial (norms, router biases included), as the
    trainer lays it out: a mapping that drops or swaps any of them changes the loss."""
    model = Transformer(m)
    model.init_weights(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            if name.endswith(("wq.weight", "wk.weight")):  # sharp attention: RoPE's layout then shows
                p.mul_(10)
        for moe in model.moe_layers():
            moe.router.bias.copy_(0.05 * torch.randn_like(moe.router.bias))
    return _save(model.state_dict(), tmp / "checkpoints" / "step_00000005", m, step=5)


def _save(state: dict, path: Path, m: Model, step: int, write_marker: bool = True) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if write_marker:
        files = {f.name: sha256_file(f) for f in path.iterdir()}
        (path / COMPLETE).write_text(json.dumps({"step": step, "files": files, "model": m.model_dump(mode="json")}))
    return path


def _export(checkpoint: Path, out: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        export(checkpoint, out, dtype="fp32", shard_bytes=150_000, say=lambda s: None)  # several shards
    return out


def _round_trip_worker(rank: int, world: int, hf: str, again: str) -> dict:
    tokens = _batch(GLM)
    losses = {}
    for name, parallel in LAYOUTS.items():
        model = build_model(GLM, parallel, torch.device("cpu"), seed=123, mesh=Meshes.build(parallel, "cpu"))
        read = load_pretrained(model, GLM, Path(hf))
        with torch.no_grad():  # every rank the whole batch: each computes the full loss
            losses[name] = (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).item(), read)
        if name == "ep1_dp2":
            path = Path(again) / "checkpoints" / "step_00000001"
            _save(model.state_dict(), path, GLM, step=1, write_marker=False)
            dist.barrier()
            if rank == 0:
                files = {f.name: sha256_file(f) for f in path.iterdir()}
                marker = {"step": 1, "files": files, "model": GLM.model_dump(mode="json")}
                (path / COMPLETE).write_text(json.dumps(marker))
    return losses


@pytest.mark.slow
def test_round_trip_at_another_layout_equals_transformers_and_exports_bit_identical(tmp_path):
    from safetensors import safe_open

    hf = _export(_trained_checkpoint(tmp_path / "run", GLM), tmp_path / "hf")
    ranks = spawn(_round_trip_worker, 2, tmp_path / "spawn", str(hf), str(tmp_path / "again"))

    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = _batch(GLM)
    with torch.no_grad():
        theirs = loss_fn(ref(tokens[:, :-1]).logits.float(), tokens[:, 1:]).item()
    random_init = build_model(GLM, Parallel(mixed_precision="fp32"), torch.device("cpu"), seed=123)
    with torch.no_grad():
        untrained = loss_fn(random_init(tokens[:, :-1]), tokens[:, 1:]).item()
    assert abs(untrained - theirs) > 0.01  # the loaded weights, not the initialisation, decide the loss
    total = sum(p.numel() for p in Transformer(GLM).state_dict().values())
    for rank, losses in enumerate(ranks):
        for name, (loss, read) in losses.items():
            assert abs(loss - theirs) < 1e-4, f"rank {rank} at {name}: {loss} vs transformers {theirs}"
            # each rank reads its shards (half of every sharded tensor; the small replicated ones whole)
            assert read < 0.6 * total, f"rank {rank} at {name} read {read} of {total} elements"

    again = _export(tmp_path / "again" / "checkpoints", tmp_path / "hf2")
    names = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    names2 = json.loads((again / "model.safetensors.index.json").read_text())["weight_map"]
    assert names.keys() == names2.keys()
    for name in names:
        with safe_open(str(hf / names[name]), "pt") as a, safe_open(str(again / names2[name]), "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


# -- a directory transformers wrote --------------------------------------------------------------


def _qwen3_dir(out: Path, m: Model, **config) -> Path:
    """`save_pretrained` of a random Qwen3MoeForCausalLM shaped as `m` (its published checkpoints'
    norm_topk_prob true; transformers' default config says false, which the router cannot express)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=m.vocab,
        hidden_size=m.dim,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        num_experts=m.experts,
        num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.expert_hidden,
        intermediate_size=m.dense_hidden,
        mlp_only_layers=[i for i in range(m.layers) if not m.is_moe(i)],
        max_position_embeddings=m.seq_len,
        rope_theta=m.rope_theta,
        norm_topk_prob=True,
        **config,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms: a norm mapped to the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: RoPE's layout then shows
                p.mul_(10)
    model.save_pretrained(out)
    return out


def _local_stack(tmp: Path, **model) -> tuple[list[str], Model]:
    """The dev stack with a Qwen3-shaped local model: (CLI flags, the model)."""
    from supernode.core.config import load_file

    doc = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    doc["config"]["supernode:local"]["model"].update({"qkNorm": True, "sharedExperts": 0, "router": "softmax", **model})
    doc["config"]["supernode:local"]["training"].update({"warmupSteps": 1})
    f = tmp / "Pulumi.ft.yaml"
    f.write_text(yaml.safe_dump(doc))
    return ["--config", str(f), "--local"], load_file(f).local_config().model


def test_transformers_checkpoint_loads_with_its_logits(tmp_path, group):
    flags, m = _local_stack(tmp_path)
    hf = _qwen3_dir(tmp_path / "qwen3", m)
    write_manifest(hf, "Qwen3MoeForCausalLM")
    model = build_model(m, Parallel(mixed_precision="fp32"), torch.device("cpu"), seed=0)
    load_pretrained(model, m, hf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = _batch(m)[:, :-1]
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max().item() < 1e-4


def test_import_prints_what_differs_and_writes_the_manifest(tmp_path, capsys):
    flags, m = _local_stack(tmp_path)
    hf = _qwen3_dir(tmp_path / "qwen3", m)
    assert cli(["import", *flags, "--from", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "fits the stack's local.model" in out and "--write-manifest" in out and not (hf / MANIFEST).exists()
    assert cli(["import", *flags, "--from", str(hf), "--write-manifest"]) == 0
    out = capsys.readouterr().out
    assert f"local.training.initFromSha256: {sha256_file(hf / MANIFEST)}" in out
    manifest = json.loads((hf / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in hf.iterdir()} - {MANIFEST}
    assert cli(["import", *flags, "--from", str(hf), "--write-manifest"]) == 2  # never replaces a manifest
    assert f"{hf / MANIFEST} exists" in capsys.readouterr().err

    other, _ = _local_stack(tmp_path, dim=256, experts=8)
    assert cli(["import", *other, "--from", str(hf)]) == 1
    out = capsys.readouterr().out
    assert "local.model.dim: 256 in the stack, 128 in config.json" in out
    assert "local.model.experts: 8 in the stack, 4 in config.json" in out


@pytest.mark.parametrize(
    "field,value",
    [("norm_topk_prob", False), ("rms_norm_eps", 1e-5), ("head_dim", 32), ("hidden_act", "gelu")],
)
def test_configs_the_model_cannot_express_are_refused_naming_the_field(tmp_path, field, value):
    _, m = _local_stack(tmp_path)
    cfg = json.loads((_qwen3_dir(tmp_path / "qwen3", m) / "config.json").read_text())
    cfg[field] = value
    diffs = compare(cfg, m, "local.model")
    assert diffs and diffs[0].refused and diffs[0].field == field and diffs[0].theirs == value


def test_another_architecture_is_incompatible(tmp_path, capsys):
    flags, _ = _local_stack(tmp_path)
    hf = tmp_path / "mixtral"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "hidden_size": 128}))
    assert cli(["import", *flags, "--from", str(hf)]) == 1
    assert "architectures: ['MixtralForCausalLM'] in config.json cannot be trained here" in capsys.readouterr().out
    assert cli(["import", *flags, "--from", str(tmp_path / "absent")]) == 2


def test_glm45_style_routing_is_refused():
    cfg = {
        "architectures": ["Glm4MoeForCausalLM"],
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 0.5,
        "norm_topk_prob": True,
    }
    refused = {d.field for d in compare(cfg, GLM) if d.refused}
    assert {"n_group", "topk_group", "routed_scaling_factor", "partial_rotary_factor"} <= refused


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, group):
    _, m = _local_stack(tmp_path)
    hf = _qwen3_dir(tmp_path / "qwen3", m)
    write_manifest(hf, "Qwen3MoeForCausalLM")
    weights = hf / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01
    weights.write_bytes(bytes(data))
    model = build_model(m, Parallel(mixed_precision="fp32"), torch.device("cpu"), seed=0)
    with pytest.raises(BadInput, match=rf"{weights}: sha256 .* does not match {MANIFEST}"):
        load_pretrained(model, m, hf)
    pin = "0" * 64
    with pytest.raises(BadInput, match="is not training.initFromSha256"):
        load_pretrained(model, m, hf, manifest_sha256=pin)


def test_a_safetensors_header_that_lies_is_refused_naming_the_file(tmp_path, group):
    """Issue 41 (hostile safetensors): a header whose offsets run past the data, written before the
    manifest (the publisher's lie, so every sha256 matches), is BadInput naming the file, not the
    safetensors library's exception from inside the trainer."""
    import struct

    _, m = _local_stack(tmp_path)
    hf = _qwen3_dir(tmp_path / "qwen3", m)
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096
    lie = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(lie)) + lie + data[8 + n :])
    write_manifest(hf, "Qwen3MoeForCausalLM")
    model = build_model(m, Parallel(mixed_precision="fp32"), torch.device("cpu"), seed=0)
    with pytest.raises(BadInput, match=rf"training.initFrom {weights}: not a readable safetensors file \(.*header"):
        load_pretrained(model, m, hf)


# -- the trainer: initFrom at step 0, resume wins after -------------------------------------------


def _train(tmp: Path, plan_file: Path, data: Path, out: Path, steps: int) -> subprocess.CompletedProcess:
    """Under the launcher (the cluster job's entry point): bad input exits 2, without torchrun's traceback."""
    cmd = [sys.executable, "-m", "supernode.trainer.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--module", "supernode.trainer.train", "--plan", str(plan_file), "--data", str(data), "--out", str(out)]
    cmd += ["--steps", str(steps), "--sync-checkpoint"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_trainer_starts_from_a_transformers_checkpoint_and_refuses_a_corrupt_one(tmp_path):
    from supernode.core.config import load_file
    from supernode.core.plan import build_local_plan
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    flags, m = _local_stack(tmp_path)
    hf = _qwen3_dir(tmp_path / "qwen3", m)
    write_manifest(hf, "Qwen3MoeForCausalLM")
    doc = yaml.safe_load(Path(flags[1]).read_text())
    doc["config"]["supernode:local"]["training"].update(initFrom=str(hf), initFromSha256=sha256_file(hf / MANIFEST))
    Path(flags[1]).write_text(yaml.safe_dump(doc))
    plan = build_local_plan("ft", load_file(Path(flags[1])), 2)  # dev's local layout: dp 2 x ep 2
    assert plan.training.init_from == str(hf)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    data = tmp_path / "data"
    prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)

    r = _train(tmp_path, plan_file, data, tmp_path / "out", steps=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"step 0 starts from the weights in {hf}" in r.stdout
    first = [
        json.loads(x) for x in (run_of(tmp_path / "out") / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert first and all(torch.isfinite(torch.tensor(rec["loss"])) for rec in first)
    # A random model's loss is ln(vocab) = 5.5 at step 1; transformers' random init (std 0.02) starts there too,
    # so the load is proven by test_transformers_checkpoint_loads_with_its_logits; here: it trains.
    r = _train(tmp_path, plan_file, data, tmp_path / "out", steps=2)  # resumes: the checkpoint wins
    assert (
        r.returncode == 0
        and "resumed from checkpoint at step 1" in r.stdout
        and "starts from the weights" not in r.stdout
    )

    weights = hf / "model.safetensors"
    data_bytes = bytearray(weights.read_bytes())
    data_bytes[-100] ^= 0x01
    weights.write_bytes(bytes(data_bytes))
    r = _train(tmp_path, plan_file, data, tmp_path / "fresh", steps=1)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.count(f"error: training.initFrom: {weights}: sha256") == 1  # once: rank 0
    assert "Traceback" not in r.stderr and complete_checkpoints(checkpoints_of(tmp_path / "fresh")) == []
