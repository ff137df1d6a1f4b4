"""A DCP training checkpoint -> a Hugging Face model directory that vLLM and SGLang serve.

    OUT/config.json                      Glm4MoeForCausalLM or Qwen3MoeForCausalLM (supernode.core.inference)
    OUT/model-00001.safetensors ...      the weights at the serving dtype, in shards of about --shard-gib
    OUT/model.safetensors.index.json     tensor -> shard
    OUT/tokenizer.json, tokenizer_config.json   the data's tokenizer (bytes: an equivalent tokenizer.json)
    OUT/generation_config.json
    OUT/manifest.json                    written last: every other file's sha256 and size, the source
                                         checkpoint and step, and `format` (supernode-export/1, the
                                         export's own kind); what `supernode serve` and the cluster's
                                         init container verify before a server starts

Streams tensor by tensor: each tensor is read from the sharded checkpoint on its own (DCP reads only
its byte ranges), converted and appended to the current shard, which is written once it reaches
the shard size; memory stays at one shard plus one tensor whatever the model's size. The directory
is built under .OUT.tmp-PID next to it and renamed into place, so OUT is either complete or absent;
a failed export (a full disk included) removes what it wrote. OUT must be absent or an earlier export
holding only the files its manifest lists: an export replaces nothing else (a dataset, a checkpoint).

Conventions mapped (exactly; tests/trainer/test_export.py compares logits with `transformers`):
RoPE pairs (even, odd) here, halves there: the rows of wq/wk (and the qk-norm weights) are permuted
per head; stacked experts [E, in, out] become per-expert `nn.Linear` weights [out, in]; the router's
aux-loss-free bias becomes `e_score_correction_bias` (GLM-4.5) or must be zero (Qwen3).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader

from supernode.core import runs
from supernode.core.checkpoints import COMPLETE, checkpoint_problem, complete_checkpoints, read_marker
from supernode.core.config.schema import Model
from supernode.core.errors import BadInput
from supernode.core.files import sha256_file
from supernode.core.inference import DTYPES, GLM4_MOE, hf_config, served_architecture

from ..model import Transformer

MANIFEST = "manifest.json"
FORMAT = "supernode-export/1"
TORCH_DTYPES = {name: getattr(torch, d.torch_name) for name, d in DTYPES.items()}
PREFIX = "model."  # the model's keys in the training checkpoint (supernode.trainer.checkpoint.train_state)


class NoSpace(Exception):
    """The export did not fit on the disk (what it had written is removed): exit 1, said in one line."""


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, a checkpoints root (its newest complete checkpoint), or a training output
    directory (its latest run's newest: supernode.core.runs)."""
    if (path / COMPLETE).is_file():
        return path
    if (path / runs.RUNS).is_dir():
        path = runs.checkpoints_of(path)
    found = complete_checkpoints(path)
    if not found:
        raise BadInput(f"--checkpoint {path}: no complete checkpoint (a step_N directory with a {COMPLETE} marker)")
    return found[-1][1]


def checkpoint_model(path: Path, fallback: Model | None) -> Model:
    """The model the checkpoint was trained as (its marker records it), else `fallback`."""
    recorded = read_marker(path).get("model")
    if recorded is not None:
        try:
            return Model.model_validate(recorded)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise BadInput(
                f"{path / COMPLETE}: model{'.' + where if where else ''}: {first['msg']}; the marker's model is "
                "unreadable (edited?): export a checkpoint whose marker the trainer wrote"
            ) from None
    if fallback is None:
        raise BadInput(f"--checkpoint {path}: its marker records no model; give --stack")
    return fallback


def _check_shapes(path: Path, m: Model, assumed: bool) -> int:
    """The checkpoint holds exactly `m`'s tensors, name for name and shape for shape (read from its
    metadata, nothing loaded), else BadInput naming the first that differs: the exported config.json
    must describe the weights beside it. -> the number of model parameters."""
    with torch.device("meta"):  # shapes only, no memory
        want = {PREFIX + k: tuple(v.shape) for k, v in Transformer(m).state_dict().items()}
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {k: tuple(md.size) for k, md in meta.items() if k.startswith(PREFIX) and hasattr(md, "size")}
    for key in sorted(want.keys() | have.keys()):
        if want.get(key) != have.get(key):
            whose = "the stack's model (the marker records none)" if assumed else "the model its marker records"
            raise BadInput(
                f"--checkpoint {path}: tensor {key} is {list(have[key]) if key in have else 'absent'} there and "
                f"{list(want[key]) if key in want else 'absent'} in {whose}; export it with the stack "
                "(and --local or not) it was trained with"
            )
    return sum(math.prod(shape) for shape in have.values())


def _prior_export(out: Path) -> None:
    """BadInput unless `out` is absent or an earlier export holding only the files its manifest lists:
    the one folder an export deletes (to replace it). A dataset (its manifest.json is a data manifest),
    a checkpoint, `--data` itself or any other folder is never deleted."""
    if not out.exists() and not out.is_symlink():
        return
    try:
        prior = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        prior = None
    # `format` is the export's own kind: a data manifest has another (an integer).
    if out.is_symlink() or not isinstance(prior, dict) or prior.get("format") != FORMAT:
        raise BadInput(
            f"--out {out} exists and is not an earlier export (no {MANIFEST} of format {FORMAT}); an export "
            "replaces only its own output: choose another --out"
        )
    listed = prior.get("files")
    ours = {*(listed if isinstance(listed, dict) else ()), MANIFEST}
    for p in sorted(out.iterdir()):
        if p.name not in ours or p.is_symlink() or not p.is_file():
            raise BadInput(
                f"--out {out}: {p} is not a file of the export there (its {MANIFEST} does not list it); an export "
                "replaces only its own output: move it away or choose another --out"
            )


def _no_space(exc: BaseException | None) -> bool:
    """A full disk or quota: an OSError's errno, or safetensors' Rust I/O error ("os error 28")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if f"(os error {errno.ENOSPC})" in str(exc) or f"(os error {errno.EDQUOT})" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def rope_halves(w: Tensor, head_dim: int) -> Tensor:
    """Rows of a q/k projection (or a per-head norm weight) from (even, odd) RoPE pairs to halves."""
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    return torch.cat((heads[:, 0::2], heads[:, 1::2]), dim=1).reshape(w.shape)


Convert = list[tuple[str, Callable[[Tensor], Tensor]]]


def hf_names(key: str, m: Model, arch: str) -> Convert:
    """Our parameter `key` -> [(HF name, conversion)] (several for stacked experts)."""
    same: Callable[[Tensor], Tensor] = lambda t: t  # noqa: E731
    rope: Callable[[Tensor], Tensor] = lambda t: rope_halves(t, m.head_dim)  # noqa: E731
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if key in top:
        return [] if key == "output.weight" and m.tie_embeddings else [(top[key], same)]
    parts = key.split(".")
    if parts[0] != "layers":
        raise BadInput(f"checkpoint tensor {key!r} has no counterpart in {arch}")
    i, rest = parts[1], ".".join(parts[2:])
    layer = f"model.layers.{i}."
    simple = {
        "attention_norm.weight": ("input_layernorm.weight", same),
        "ffn_norm.weight": ("post_attention_layernorm.weight", same),
        "attention.wq.weight": ("self_attn.q_proj.weight", rope),
        "attention.wk.weight": ("self_attn.k_proj.weight", rope),
        "attention.wv.weight": ("self_attn.v_proj.weight", same),
        "attention.wo.weight": ("self_attn.o_proj.weight", same),
        "attention.q_norm.weight": ("self_attn.q_norm.weight", rope),
        "attention.k_norm.weight": ("self_attn.k_norm.weight", rope),
        "ffn.w1.weight": ("mlp.gate_proj.weight", same),
        "ffn.w3.weight": ("mlp.up_proj.weight", same),
        "ffn.w2.weight": ("mlp.down_proj.weight", same),
        "ffn.router.gate.weight": ("mlp.gate.weight", same),
        "ffn.shared.w1.weight": ("mlp.shared_experts.gate_proj.weight", same),
        "ffn.shared.w3.weight": ("mlp.shared_experts.up_proj.weight", same),
        "ffn.shared.w2.weight": ("mlp.shared_experts.down_proj.weight", same),
    }
    if rest in simple:
        name, fn = simple[rest]
        return [(layer + name, fn)]
    if rest == "ffn.router.bias":
        if arch == GLM4_MOE:
            return [(layer + "mlp.gate.e_score_correction_bias", same)]
        return [("", same)]  # Qwen3: no bias; `_stream` checks it is zero
    experts = {"ffn.experts.w1": "gate_proj", "ffn.experts.w3": "up_proj", "ffn.experts.w2": "down_proj"}
    if rest in experts:
        # [E, in, out] (x @ w) -> per expert nn.Linear weight [out, in]
        return [(f"{layer}mlp.experts.{e}.{experts[rest]}.weight", lambda t, e=e: t[e].t()) for e in range(m.experts)]
    raise BadInput(f"checkpoint tensor {key!r} has no counterpart in {arch}")


def _stream(path: Path, m: Model, arch: str, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) one checkpoint tensor at a time."""
    reader = FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    for key in [k for k in meta if k.startswith(PREFIX)]:  # _check_shapes: exactly the model's
        md = meta[key]
        if not hasattr(md, "size"):
            continue
        buf = {key: torch.empty(md.size, dtype=md.properties.dtype)}
        dcp.load(buf, storage_reader=reader, no_dist=True)
        t = buf.pop(key)
        for name, fn in hf_names(key[len(PREFIX) :], m, arch):
            if not name:
                if t.abs().max().item() != 0:
                    raise BadInput(
                        f"{key}: the router's selection bias is not zero, and {arch} has none "
                        "(train softmax routing with model.biasUpdateRate: 0)"
                    )
                continue
            # The router's selection bias stays fp32 (a correction that small would round away in bf16).
            out = fn(t).to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)
            yield name, out.contiguous()
        del t


def _byte_tokenizer_json(out: Path) -> None:
    """A tokenizer.json equal to the byte tokenizer (id = UTF-8 byte): byte-level BPE without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenisation maps bytes to)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer(data: Path | None, tmp: Path) -> tuple[int | None, str | None]:
    """Copy (or, for bytes, write) the data's tokenizer; -> (EOS id, EOS token)."""
    if data is None:
        return None, None
    from ..data.manifest import read_manifest
    from ..data.tokenizer import TOKENIZER_FILE, from_file

    manifest = read_manifest(data)
    kind = (manifest.get("tokenizer") or {}).get("kind", "bytes")
    if kind == "bytes":
        _byte_tokenizer_json(tmp / TOKENIZER_FILE)
        eos_id, eos_token = int(manifest.get("eos", 0)), _bytes_to_unicode()[int(manifest.get("eos", 0))]
    else:
        shutil.copyfile(Path(data) / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        tok = from_file(tmp / TOKENIZER_FILE, manifest["tokenizer"].get("eos_token"))
        eos_id, eos_token = tok.eos, tok.eos_token
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_token,
                "model_max_length": None,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        ),
        encoding="utf-8",
    )
    return eos_id, eos_token


def export(
    checkpoint: Path,
    out: Path,
    model: Model | None = None,
    dtype: str = "bf16",
    data: Path | None = None,
    shard_bytes: int = 2 << 30,
    say: Callable[[str], None] = print,
) -> dict:
    """Export the checkpoint (a step directory or a checkpoints root) to `out`; returns the manifest.

    `model`: the stack's model, used only when the checkpoint records none, and compared with it when
    it does (a checkpoint of another model is refused). `data`: the prepared dataset whose tokenizer
    is shipped with the model."""
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    path = resolve_checkpoint(Path(checkpoint))
    problem = checkpoint_problem(path)
    if problem:
        raise BadInput(f"--checkpoint {path}: {problem}; export a checkpoint that verifies")
    m = checkpoint_model(path, model)
    if model is not None and model.model_dump() != m.model_dump():
        differ = [k for k, v in model.model_dump().items() if m.model_dump()[k] != v]
        raise BadInput(
            f"--checkpoint {path} was trained as another model than the stack's: "
            + ", ".join(
                f"model.{k} {m.model_dump()[k]!r} there, {model.model_dump()[k]!r} in the stack" for k in differ
            )
        )
    arch = served_architecture(m)
    params = _check_shapes(path, m, assumed=read_marker(path).get("model") is None)
    out = Path(out)
    _prior_export(out)
    out = out.resolve()  # `--out .` has a name to put the temporary folder beside
    # Our own name (not OUT.tmp, which may be someone's folder): a folder there already is refused, not deleted.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        manifest, shards = _write(tmp, path, m, arch, dtype, data, shard_bytes)
        if out.exists():  # an earlier export (_prior_export): swapped out, then deleted
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(e):
            need = params * TORCH_DTYPES[dtype].itemsize
            raise NoSpace(
                f"no space left on {out.parent} for the export of {path} (~{need / 2**20:,.1f} MiB of weights; "
                f"{shutil.disk_usage(out.parent).free / 2**20:,.1f} MiB free); nothing was written: free space "
                "or choose another --out, then run again"
            ) from None
        raise
    say(
        f"exported step {manifest['source']['step']} of {path.parent} as {arch} ({dtype}, "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB in {shards} shard(s)) to {out}"
    )
    return manifest


def _umask() -> int:
    """The process umask (read by setting it and putting it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write(
    tmp: Path, path: Path, m: Model, arch: str, dtype: str, data: Path | None, shard_bytes: int
) -> tuple[dict, int]:
    """The export's files in `tmp`, the manifest last; -> (the manifest, the number of shards)."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict[str, Tensor] = {}
    size = total = 0
    shards = 0

    def flush() -> None:
        nonlocal shard, size, shards
        if shard:
            shards += 1
            name = f"model-{shards:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            # safetensors renames a private temporary file (mode 0600) into place: give the shard the
            # mode the export's other files get (0644 under the usual umask), or a server running as
            # another user cannot read the weights beside their readable config
            os.chmod(tmp / name, 0o666 & ~_umask())
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, t in _stream(path, m, arch, TORCH_DTYPES[dtype]):
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2),
        encoding="utf-8",
    )
    eos, _ = _tokenizer(data, tmp)
    (tmp / "config.json").write_text(json.dumps(hf_config(m, dtype, eos=eos), indent=2), encoding="utf-8")
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    manifest = {
        "format": FORMAT,
        "architecture": arch,
        "dtype": dtype,
        "total_bytes": total,
        "source": {"checkpoint": str(path), "step": read_marker(path).get("step")},
        "files": {
            f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in sorted(tmp.iterdir())
            if f.name != MANIFEST
        },
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest, shards
