"""Export: a DCP checkpoint -> a Hugging Face directory whose logits equal ours (transformers loads it).

Tolerance: fp32 export, max |logit difference| < 1e-4 (the two forward passes differ only in
summation order; a wrong mapping — RoPE layout, a transposed expert, a missing bias — is off by O(1)).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from supernode.core.checkpoints import COMPLETE
from supernode.core.config import Model
from supernode.core.errors import BadInput
from supernode.core.files import sha256_file
from supernode.core.inference import GLM4_MOE, QWEN3_MOE
from supernode.trainer.hf.export import MANIFEST, export, rope_halves
from supernode.trainer.model import Transformer, apply_rope, rope_tables

transformers = pytest.importorskip("transformers")

GLM = Model(
    layers=3,
    dim=128,
    heads=2,
    kv_heads=1,
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
QWEN = Model(
    layers=3,
    dim=128,
    heads=4,
    kv_heads=2,
    experts=4,
    top_k=2,
    expert_hidden=48,
    dense_hidden=160,
    moe_every=2,
    vocab=96,
    seq_len=32,
    router="softmax",
    qk_norm=True,
    bias_update_rate=0.0,
)


def _checkpoint(tmp: Path, m: Model, seed: int = 0, bias: bool = True) -> tuple[Transformer, Path]:
    """A committed checkpoint of a randomly initialised model, laid out as the trainer writes it."""
    torch.manual_seed(seed)
    model = Transformer(m)
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms: a misplaced one would show
                p.copy_(1 + 0.3 * torch.randn_like(p))
        if bias:
            for moe in model.moe_layers():  # the aux-loss-free bias must steer selection in both
                moe.router.bias.copy_(0.05 * torch.randn_like(moe.router.bias))
    path = tmp / "checkpoints" / "step_00000007"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    files = {f.name: sha256_file(f) for f in path.iterdir()}
    (path / COMPLETE).write_text(json.dumps({"step": 7, "files": files, "model": m.model_dump(mode="json")}))
    return model.eval(), path


def _export(tmp: Path, path: Path, **kw) -> Path:
    out = tmp / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        export(path.parent, out, say=lambda s: None, **kw)
    return out


@pytest.mark.parametrize("m,arch", [(GLM, GLM4_MOE), (QWEN, QWEN3_MOE)], ids=["glm4_moe", "qwen3_moe"])
def test_logits_equal_transformers(tmp_path, m, arch):
    ours, path = _checkpoint(tmp_path, m, bias=m.router == "sigmoid")
    out = _export(tmp_path, path, dtype="fp32", shard_bytes=200_000)  # several shards
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["architecture"] == arch and manifest["source"]["step"] == 7
    assert len([f for f in manifest["files"] if f.endswith(".safetensors")]) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    tokens = torch.randint(0, m.vocab, (3, m.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(tokens), hf(tokens).logits.float()
    assert a.abs().max() > 0.1  # not trivially zero
    assert (a - b).abs().max().item() < 1e-4
    # Greedy decoding agrees token for token (the KV-cache path of transformers, too).
    prompt = tokens[:1, :5]
    hf_ids = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:]
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, ours(seq)[:, -1:].argmax(-1)], dim=1)
    assert seq[0, 5:].tolist() == hf_ids.tolist()


def test_rope_permutation_preserves_attention_scores():
    """Our (even, odd) RoPE on x equals the halves convention on the permuted x: q.k unchanged."""
    hd, s = 8, 5
    cos, sin = rope_tables(s, hd, 10000.0)
    q, k = torch.randn(1, s, 1, hd), torch.randn(1, s, 1, hd)
    ours = (apply_rope(q, cos, sin) * apply_rope(k, cos, sin)).sum(-1)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    emb = torch.cat(
        [torch.outer(torch.arange(s).float(), 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd))] * 2, -1
    )
    perm = lambda t: rope_halves(t.reshape(s, hd).t(), hd).t().reshape(1, 1, s, hd)  # noqa: E731
    qh, kh = apply_rotary_pos_emb(perm(q), perm(k), emb.cos()[None], emb.sin()[None])
    assert torch.allclose(ours.flatten(), (qh * kh).sum(-1).flatten(), atol=1e-5)


def test_bf16_export_and_tokenizer(tmp_path):
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    _, path = _checkpoint(tmp_path, GLM.model_copy(update={"vocab": 256}))
    prepare(DEFAULT_CORPUS[:1], tmp_path / "data", shard_tokens=1 << 16)
    out = _export(tmp_path, path, dtype="bf16", data=tmp_path / "data")
    from safetensors import safe_open

    with safe_open(str(out / "model-00001.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        # the selection bias stays fp32: a 1e-3 correction would round away next to scores ~0.5 in bf16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # é"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))  # = the byte tokenizer
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    _, path = _checkpoint(tmp_path, GLM)
    out = _export(tmp_path, path, dtype="fp32")
    manifest = json.loads((out / MANIFEST).read_text())
    on_disk = {f.name for f in out.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk
    assert all(manifest["files"][n]["sha256"] == sha256_file(out / n) for n in on_disk)
    assert not (tmp_path / "hf.tmp").exists()


@pytest.mark.parametrize(
    "update,needle",
    [
        ({"router": "softmax", "shared_experts": 1}, "sharedExperts must be 0"),
        ({"router": "softmax", "shared_experts": 0, "qk_norm": False, "bias_update_rate": 0.0}, "qkNorm"),
        ({"router": "softmax", "shared_experts": 0, "qk_norm": True}, "biasUpdateRate must be 0"),
        ({"shared_experts": 0}, "sharedExperts must be at least 1"),
        ({"moe_every": 2}, "moeEvery 2"),
    ],
)
def test_unmappable_configs_are_rejected(tmp_path, update, needle):
    m = GLM.model_copy(update=update)
    _, path = _checkpoint(tmp_path, m)
    with pytest.raises(BadInput, match=needle):
        _export(tmp_path, path)
    assert not (tmp_path / "hf").exists()


def test_nonzero_bias_under_softmax_is_rejected(tmp_path):
    """The config says no bias, but the checkpoint carries one: the tensors decide."""
    _, path = _checkpoint(tmp_path, QWEN, bias=True)
    with pytest.raises(BadInput, match="selection bias is not zero"):
        _export(tmp_path, path)


def test_corrupt_checkpoint_and_other_model_are_refused(tmp_path):
    _, path = _checkpoint(tmp_path, GLM)
    with pytest.raises(BadInput, match="trained as another model.*model.dim 128 there, 256 in the stack"):
        export(path, tmp_path / "hf", model=GLM.model_copy(update={"dim": 256}), say=lambda s: None)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    with pytest.raises(BadInput, match="does not match its recorded sha256"):
        export(path, tmp_path / "hf", say=lambda s: None)


# -- what an export may write over and what a failed one leaves ---------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DEV_LOCAL = ["--stack", "dev", "--root", str(ROOT), "--local"]


def _dev_checkpoint(tmp: Path) -> Path:
    """A checkpoint of the dev stack's local model (what `supernode export --stack dev --local` takes)."""
    from supernode.core.config import load_stack

    return _checkpoint(tmp, load_stack("dev", ROOT).local_config().model)[1]


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_out_is_only_ever_a_new_folder_or_an_earlier_export(tmp_path, capsys):
    from supernode.cli import main
    from supernode.trainer.data.manifest import verify
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    path = _dev_checkpoint(tmp_path)
    data = tmp_path / "data"
    prepare(DEFAULT_CORPUS[:1], data, shard_tokens=1 << 16)
    before = _tree(data)
    for out in (data, tmp_path):  # --out equal to --data (a data manifest); a folder without a manifest
        rc = main(["export", *DEV_LOCAL, "--checkpoint", str(path), "--data", str(data), "--out", str(out)])
        assert rc == 2
        assert f"--out {out} exists and is not an earlier export" in capsys.readouterr().err
    assert _tree(data) == before and verify(data)  # the dataset is untouched

    out, mine = tmp_path / "hf", tmp_path / "hf.tmp"
    mine.mkdir()
    (mine / "notes").write_text("someone's")  # a folder named like a temporary one is not ours to delete
    export(path, out, say=lambda s: None)
    first = _tree(out)
    export(path, out, dtype="fp32", say=lambda s: None)  # an earlier export is replaced
    assert _tree(out) != first and json.loads((out / MANIFEST).read_text())["dtype"] == "fp32"
    assert (mine / "notes").read_text() == "someone's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "data", "hf", "hf.tmp"]

    (out / "notes.txt").write_text("mine")  # an export folder that holds more than the export
    with pytest.raises(BadInput, match=r"notes.txt is not a file of the export there"):
        export(path, out, say=lambda s: None)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_marker_without_model_is_checked_against_the_stack_model(tmp_path, capsys):
    from supernode.cli import main

    _, path = _checkpoint(tmp_path, GLM)
    marker = json.loads((path / COMPLETE).read_text())
    del marker["model"]
    (path / COMPLETE).write_text(json.dumps(marker))
    out = tmp_path / "hf"
    # The stack's model is not the one trained: refused, not exported under a config.json that lies.
    assert main(["export", *DEV_LOCAL, "--checkpoint", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tensor model.embed.weight is [96, 128] there and [256, 128] in the stack's model" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    export(path, out, model=GLM, say=lambda s: None)  # the right model: exported
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == GLM.layers

    marker["model"] = {**GLM.model_dump(mode="json"), "dim": "wide"}
    (path / COMPLETE).write_text(json.dumps(marker))
    with pytest.raises(BadInput, match=r"COMPLETE: model.dim: .*the marker's model is unreadable"):
        export(path, tmp_path / "other", say=lambda s: None)


def _full_disk_says_no_space_and_leaves_nothing(tmp_path, disk: Path, capsys) -> None:
    from supernode.cli import main

    path = _dev_checkpoint(tmp_path)
    rc = main(["export", *DEV_LOCAL, "--checkpoint", str(path), "--out", str(disk / "model"), "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"export failed: no space left on {disk}") and "nothing was written" in err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1
    assert list(disk.iterdir()) == []  # no model.tmp, no partial shard


def test_a_full_disk_says_no_space_and_leaves_nothing(tmp_path, small_disk, capsys):
    _full_disk_says_no_space_and_leaves_nothing(tmp_path, small_disk, capsys)


def test_a_full_disk_injected(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own error type, "... (os error 28)": that is recognised too."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    disk = tmp_path / "disk"
    disk.mkdir()
    _full_disk_says_no_space_and_leaves_nothing(tmp_path, disk, capsys)
