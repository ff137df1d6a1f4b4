"""Starting from a pretrained Hugging Face checkpoint (`training.initFrom`): is it our model, and is it intact?

Pure (no torch): `supernode import` runs it offline, the trainer before it reads a tensor.

- **Compatibility** (`compare`): a `config.json` of `Glm4MoeForCausalLM` or `Qwen3MoeForCausalLM`
  against the stack's `model` section. A field the trainer's model has (dim, experts, ...) that
  differs is a *difference* (change the stack); a field whose value the trainer's model cannot
  express at all is a *refusal*, whatever the stack says:
  - `head_dim` other than hidden_size / num_attention_heads (our head dim is dim / heads; Qwen3-30B-A3B
    decouples them: 2048 / 32 = 64, head_dim 128);
  - `rms_norm_eps` other than 1e-6 (our RMSNorm's; GLM-4.5 uses 1e-5);
  - `hidden_act` other than silu, `attention_bias` true (no projection biases here);
  - `norm_topk_prob` false (our router always renormalises the chosen experts' weights; Qwen3's
    default config says false, the published Qwen3 MoE checkpoints true);
  - GLM: `n_group`/`topk_group` above 1 (group-limited routing), `routed_scaling_factor` other than 1,
    `partial_rotary_factor` below 1 (RoPE on part of a head): GLM-4.5 and GLM-4.5-Air set all three;
  - Qwen3: `use_sliding_window`; RoPE scaling of any kind (`rope_parameters.rope_type` not default).
  `max_position_embeddings` is not compared: the trainer's seqLen is a training choice, not a weight.

- **Integrity** (`read_manifest`, `verify_files`): the directory's `manifest.json` in the export's
  format (supernode.trainer.hf.export: `files: {name: {sha256, bytes}}`), which `supernode export`
  writes and `supernode import --write-manifest` writes for a directory `transformers` wrote. Every
  listed file must match, every safetensors file must be listed: a mismatch is bad input naming the
  file. `training.initFromSha256` pins the manifest itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from .config.schema import Model
from .errors import BadInput
from .files import plain_name, sha256_file
from .inference import GLM4_MOE, QWEN3_MOE, RMS_NORM_EPS

MANIFEST = "manifest.json"  # the export's name (supernode.trainer.hf.export.MANIFEST)
IMPORT_FORMAT = "supernode-import/1"  # a manifest `supernode import --write-manifest` wrote
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"


class Difference(NamedTuple):
    field: str  # the stack key, or the config.json field for a refusal
    ours: Any
    theirs: Any
    refused: bool  # the trainer's model cannot express `theirs`, whatever the stack says
    why: str = ""

    def line(self) -> str:
        if self.refused:
            return f"{self.field}: {self.theirs!r} in config.json cannot be trained here: {self.why}"
        return f"{self.field}: {self.ours!r} in the stack, {self.theirs!r} in config.json"


def read_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: missing; initFrom must be a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{path}: not a JSON object")
    return cfg


def architecture(cfg: dict) -> str | None:
    """The config's architecture when the trainer loads it (the ones it exports), else None."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch if arch in (GLM4_MOE, QWEN3_MOE) else None


def _rope_theta(cfg: dict) -> Any:
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", cfg.get("rope_theta", 10000.0))


def _moe_layers(cfg: dict, arch: str, layers: int) -> list[int]:
    if arch == GLM4_MOE:
        return list(range(int(cfg.get("first_k_dense_replace", 0)), layers))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0]


def compare(cfg: dict, m: Model, key: str = "model") -> list[Difference]:
    """What keeps the checkpoint described by `cfg` (config.json) from loading into `m`: the refused
    fields first, then the differing ones ([] when it fits). `key`: the stack section (model or local.model)."""
    try:
        return _compare(cfg, m, key)
    except (TypeError, ValueError) as e:  # "hidden_size": "128", "mlp_only_layers": 3, ...
        raise BadInput(f"config.json: a field has a value of the wrong type ({type(e).__name__}: {e})") from None


def _compare(cfg: dict, m: Model, key: str) -> list[Difference]:
    arch = architecture(cfg)
    if arch is None:  # Mixtral, DeepSeek-V3, ...: another model, whatever its sizes
        why = f"the trainer loads {GLM4_MOE} or {QWEN3_MOE} (the architectures it exports)"
        return [Difference("architectures", None, cfg.get("architectures"), True, why)]
    glm = arch == GLM4_MOE
    out: list[Difference] = []

    def refuse(field: str, theirs: Any, why: str) -> None:
        out.append(Difference(field, None, theirs, True, why))

    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        refuse("head_dim", head_dim, f"the head dim is hidden_size / num_attention_heads here ({hidden // heads})")
    if cfg.get("rms_norm_eps", RMS_NORM_EPS) != RMS_NORM_EPS:
        refuse("rms_norm_eps", cfg.get("rms_norm_eps"), f"the model's RMSNorm uses {RMS_NORM_EPS}")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", cfg.get("hidden_act"), "the experts and dense layers are SwiGLU (silu)")
    if cfg.get("attention_bias"):
        refuse("attention_bias", True, "the attention projections have no bias")
    if not cfg.get("norm_topk_prob", False):
        refuse("norm_topk_prob", cfg.get("norm_topk_prob", False), "the router renormalises the top-k weights")
    rope_type = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default" or cfg.get("rope_scaling"):
        refuse("rope_parameters.rope_type", rope_type, "RoPE without scaling only")
    if glm:
        for field in ("n_group", "topk_group"):
            if cfg.get(field, 1) != 1:
                refuse(field, cfg[field], "group-limited routing is not implemented (1 group)")
        if cfg.get("routed_scaling_factor", 1.0) != 1.0:
            refuse("routed_scaling_factor", cfg["routed_scaling_factor"], "the routed experts' output is not scaled")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            refuse("partial_rotary_factor", cfg["partial_rotary_factor"], "RoPE rotates the whole head")
    elif cfg.get("use_sliding_window"):
        refuse("use_sliding_window", True, "attention is full causal")

    experts = cfg.get("n_routed_experts") if glm else cfg.get("num_experts", cfg.get("num_local_experts"))
    layers = cfg.get("num_hidden_layers")
    theirs = {
        "layers": layers,
        "dim": hidden,
        "heads": heads,
        "kvHeads": cfg.get("num_key_value_heads", heads),
        "experts": experts,
        "topK": cfg.get("num_experts_per_tok"),
        "sharedExperts": cfg.get("n_shared_experts", 0) if glm else 0,
        "expertHidden": cfg.get("moe_intermediate_size"),
        "vocab": cfg.get("vocab_size"),
        "router": "sigmoid" if glm else "softmax",
        "ropeTheta": _rope_theta(cfg),
        "tieEmbeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkNorm": bool(cfg.get("use_qk_norm", False)) if glm else True,
    }
    ours = {
        "layers": m.layers,
        "dim": m.dim,
        "heads": m.heads,
        "kvHeads": m.kv_heads,
        "experts": m.experts,
        "topK": m.top_k,
        "sharedExperts": m.shared_experts,
        "expertHidden": m.expert_hidden,
        "vocab": m.vocab,
        "router": m.router,
        "ropeTheta": m.rope_theta,
        "tieEmbeddings": m.tie_embeddings,
        "qkNorm": m.qk_norm,
    }
    for field, value in ours.items():
        if theirs[field] != value:
            out.append(Difference(f"{key}.{field}", value, theirs[field], False))
    if isinstance(layers, int) and layers == m.layers:
        want = [i for i in range(m.layers) if m.is_moe(i)]
        have = _moe_layers(cfg, arch, layers)
        if want != have:
            out.append(Difference(f"{key}.firstDenseLayers/moeEvery (MoE layers)", want, have, False))
        if len(want) < m.layers and cfg.get("intermediate_size") != m.dense_hidden:
            out.append(Difference(f"{key}.denseHidden", m.dense_hidden, cfg.get("intermediate_size"), False))
    return sorted(out, key=lambda d: not d.refused)


def check_compatible(directory: Path, m: Model, key: str = "model") -> str:
    """The architecture, once `directory`'s config.json fits `m`; else BadInput naming the first field."""
    cfg = read_config(directory)
    diffs = compare(cfg, m, key)
    if diffs:
        more = f" (and {len(diffs) - 1} more: supernode import --from {directory} lists them)" if len(diffs) > 1 else ""
        raise BadInput(f"training.initFrom {directory}: {diffs[0].line()}{more}")
    return str(architecture(cfg))


# -- the manifest -------------------------------------------------------------------------------


def read_manifest(directory: Path, manifest_sha256: str | None = None) -> dict[str, str]:
    """{file: sha256} of the directory's manifest (checked against `manifest_sha256`, the pin, when
    given); BadInput when it is missing, unreadable or lists a path outside the directory."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise BadInput(
            f"{path}: missing; a model directory to start from needs its sha256 manifest "
            f"(supernode import --stack S --from {directory} --write-manifest writes one)"
        )
    if manifest_sha256 and (digest := sha256_file(path)) != manifest_sha256:
        raise BadInput(f"{path}: sha256 {digest} is not training.initFromSha256 {manifest_sha256}")
    try:
        files = {str(k): str(v["sha256"]) for k, v in json.loads(path.read_text(encoding="utf-8"))["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not a manifest ({type(e).__name__}: {e})") from None
    for name in files:
        if why := plain_name(name):
            raise BadInput(f"{path}: files entry {why}")
    unlisted = sorted(
        p.name for p in Path(directory).iterdir() if p.name.endswith(".safetensors") and p.name not in files
    )
    if unlisted:
        raise BadInput(f"{Path(directory) / unlisted[0]}: not listed in {MANIFEST}; its weights are unverified")
    return files


def verify_files(directory: Path, files: dict[str, str], share: tuple[int, int] = (0, 1)) -> str | None:
    """The first problem among this share's files (index, count: file i is checked by share i mod
    count, so ranks split the hashing), or None."""
    index, count = share
    for i, (name, digest) in enumerate(sorted(files.items())):
        if i % count != index:
            continue
        f = Path(directory) / name
        if not f.is_file():
            return f"{f}: listed in {MANIFEST} but missing"
        if (actual := sha256_file(f)) != digest:
            return (
                f"{f}: sha256 {actual} does not match {MANIFEST} ({digest}): changed or corrupted; do not train from it"
            )
    return None


def weight_files(directory: Path) -> dict[str, str]:
    """tensor name -> safetensors file name (the index, else the single file's keys are read by the caller)."""
    index = Path(directory) / WEIGHTS_INDEX
    if index.is_file():
        try:
            return {str(k): str(v) for k, v in json.loads(index.read_text(encoding="utf-8"))["weight_map"].items()}
        except (ValueError, KeyError, AttributeError) as e:
            raise BadInput(f"{index}: unreadable ({type(e).__name__}: {e})") from None
    if not (Path(directory) / SINGLE_WEIGHTS).is_file():
        raise BadInput(f"{directory}: neither {WEIGHTS_INDEX} nor {SINGLE_WEIGHTS}")
    return {}


def write_manifest(directory: Path, architecture_name: str) -> dict:
    """The manifest of a directory `transformers` wrote (every file's sha256 and size), in the export's
    format; refuses to replace a manifest already there (the export's, or an earlier one)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if path.exists():
        raise BadInput(f"{path} exists; it is verified as it is (remove it first to re-record the files)")
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    manifest = {
        "format": IMPORT_FORMAT,
        "architecture": architecture_name,
        "total_bytes": sum(p.stat().st_size for p in files if p.name.endswith(".safetensors")),
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
    }
    tmp = directory / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return manifest


def is_remote(source: str) -> bool:
    return source.startswith("s3://")
