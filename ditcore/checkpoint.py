"""MiniMax-H3 checkpoints: a diffusers repository directory, validated (its files as read: checkpoint_files.py; their
digests, the fingerprints and in-place edits: digests.py).

A checkpoint is what diffusers' `MiniMaxH3ModularPipeline.from_pretrained` reads: `model_index.json` and one folder
per component (`transformer/` with its config, sharded `diffusion_pytorch_model-*.safetensors` and their index;
`scheduler/`, `audio_scheduler/`, `text_encoder/`, `tokenizer/`, `processor/`, `vae/`, `audio_vae/`). Every error is
a `CheckpointError` whose message starts with the file's path relative to the repository
(`transformer/diffusion_pytorch_model-00001-of-00002.safetensors: tensor '...': ...`).

MiniMax-H3 ships two transformer *partitions* in one repository (PARTITIONS): "base" (`transformer/`, the t2va and
fl2va workflows) and "ref" (`transformer_ref/`, ref2va), each a whole MiniMaxH3Transformer3DModel with its own
`adaln_proj`. "base" is required; "ref" is validated the same way when model_index.json names it, and must have the
base partition's page layout and stored dtype (both partitions' plans share one slab). Each partition has its own
digest (`PartitionInfo.fingerprint`): a weight update that leaves a partition's files as they were leaves its plans.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint_files import (
    BASE,
    MODEL_INDEX,
    PARTITION_TASKS,
    PARTITIONS,
    TRANSFORMER,
    CheckpointError,
    ShardHeader,
    check_partition,
    read_json,
    read_model_index,
    read_shard_header,
    repository_files,
)
from .digests import combine_digests, file_digest, partition_fingerprint
from .plans import PageLayout, is_plan_tensor
from .shards import INDEX_FILE, SINGLE_FILE, load_dtype

TRANSFORMER_CLASS = "MiniMaxH3Transformer3DModel"

# component -> the file diffusers / transformers read first from its folder; the first six are what the t2va path
# needs, processor and audio_scheduler are checked when model_index.json names them (the writer lays both out)
COMPONENT_FILES: dict[str, str] = {
    "transformer": "config.json",
    "transformer_ref": "config.json",
    "scheduler": "scheduler_config.json",
    "text_encoder": "config.json",
    "tokenizer": "tokenizer_config.json",
    "vae": "config.json",
    "audio_vae": "config.json",
    "processor": "processor_config.json",
    "audio_scheduler": "scheduler_config.json",
}
REQUIRED_COMPONENTS: tuple[str, ...] = ("transformer", "scheduler", "text_encoder", "tokenizer", "vae", "audio_vae")
# stored dtype of everything outside `_keep_in_fp32_modules`: the released bfloat16, or float32 throughout
_PROJECTION_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}
_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class PartitionInfo:
    """One validated transformer partition of a repository."""

    name: str
    """"base" or "ref" (PARTITIONS)."""
    folder: str
    """Its folder: "transformer" or "transformer_ref"."""
    transformer_config: dict[str, Any]
    layout: PageLayout
    projection_dtype: torch.dtype
    has_adaln: bool
    fingerprint: str
    """Digest of the partition's own files (config, index, shards): what its plans' pages depend on."""

    def incompatibility(self, other: PartitionInfo) -> str | None:
        """Why `other`'s pages cannot replace this partition's (layout, shapes or stored dtype differ), or None."""
        a, b = _shape_config(self.transformer_config), _shape_config(other.transformer_config)
        diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if self.projection_dtype != other.projection_dtype:
            diff.append(f"stored dtype: {self.projection_dtype} -> {other.projection_dtype}")
        if not diff:
            return None
        return f"{other.folder}/config.json: incompatible with the served {self.folder}/ ({', '.join(diff)})"


@dataclass(frozen=True)
class CheckpointInfo:
    """A validated MiniMax-H3 repository.

    The fingerprint covers model_index.json and every file in the folder of each component model_index.json names
    (transformer config, index and shards; scheduler configs; text encoder, tokenizer, processor and VAE files), all
    that decides what the model computes. modular_model_index.json is left out: it records the repository's absolute
    path, so a copy would change it while the model is the same.
    """

    path: Path
    transformer_config: dict[str, Any]
    """transformer/config.json as parsed."""
    layout: PageLayout
    projection_dtype: torch.dtype
    """stored dtype of `adaln_proj` / `norm_out.linear` (and of every tensor outside `_keep_in_fp32_modules`)."""
    has_adaln: bool
    """every plan tensor (`adaln_proj.*`, `norm_out.linear.*`) is in the transformer's shards."""
    digests: dict[str, str]
    """relative path -> digest (whole bytes for JSON/text; size, header, first/last 4 KiB per tensor for safetensors)."""
    fingerprint: str
    partitions: dict[str, PartitionInfo]
    """The repository's transformer partitions by name ("base" always; "ref" when model_index.json names it). The
    fields above (transformer_config, layout, projection_dtype, has_adaln) are the base partition's."""

    def partition(self, name: str) -> PartitionInfo:
        """The partition `name`; CheckpointError naming the missing folder when the repository has none."""
        check_partition(name)
        if name not in self.partitions:
            raise CheckpointError(
                f"{PARTITIONS[name]}/: the repository has no '{name}' partition (model_index.json names no "
                f"'{PARTITIONS[name]}' component); it serves {', '.join(self.tasks)}"
            )
        return self.partitions[name]

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this repository's partitions can run."""
        return tuple(t for name in self.partitions for t in PARTITION_TASKS[name])

    @property
    def precision(self) -> str:
        """ "mixed" (the released layout: bfloat16 outside `_keep_in_fp32_modules`) or "float32"."""
        return "float32" if self.projection_dtype == torch.float32 else "mixed"

    @property
    def preset(self) -> str:
        """The name of the preset whose transformer this is ("h3" for the released shapes), else "custom"."""
        from .presets import preset_of

        return preset_of(self.transformer_config)

    def incompatibility(self, other: CheckpointInfo) -> str | None:
        """Why `other` cannot replace this checkpoint under a running server, or None when it can: its partitions
        must be the served ones (none added, none dropped) and each must keep its plan layout, shapes and stored
        dtype. Names the folder (file) and the differing keys."""
        if set(other.partitions) != set(self.partitions):
            return (
                f"{MODEL_INDEX}: the candidate's transformer partitions are {sorted(other.partitions)}, the served "
                f"ones {sorted(self.partitions)}; an update replaces every partition together and keeps the set"
            )
        for name, served in self.partitions.items():
            why = served.incompatibility(other.partitions[name])
            if why is not None:
                return why
        return None


def _shape_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A transformer config without diffusers' bookkeeping keys (`_class_name`, `_diffusers_version`, ...)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _components(root: Path) -> list[str]:
    """Components named by model_index.json, each with its folder and first file present."""
    index = read_model_index(root)
    named = sorted(k for k in index if not k.startswith("_"))
    for comp in REQUIRED_COMPONENTS:
        if comp not in index:
            raise CheckpointError(
                f"{MODEL_INDEX}: component '{comp}' not named; a MiniMax-H3 repository has {list(REQUIRED_COMPONENTS)}"
            )
    entry = index[TRANSFORMER]
    if not (isinstance(entry, list) and len(entry) == 2 and entry[1] == TRANSFORMER_CLASS):
        raise CheckpointError(
            f"{MODEL_INDEX}: component 'transformer' is {entry!r}, expected ['diffusers', '{TRANSFORMER_CLASS}']"
        )
    for comp in named:
        first = COMPONENT_FILES.get(comp)
        if not (root / comp).is_dir():
            raise CheckpointError(f"{comp}/: component folder named by {MODEL_INDEX} is missing")
        if first is not None and not (root / comp / first).is_file():
            raise CheckpointError(f"{comp}/{first}: missing (component '{comp}')")
    return named


def _header(root: Path, rel: str, first_tensor: str | None = None) -> ShardHeader:
    """read_shard_header with the file named by its relative path (and a tensor it should hold, if known)."""
    try:
        return read_shard_header(root / rel)
    except CheckpointError as e:
        msg = f"{Path(rel).parent.as_posix()}/{e}"  # its messages start with the file's bare name
        if first_tensor is not None and "tensor '" not in msg:
            msg += f" (the index places tensor '{first_tensor}' in this file)"
        raise CheckpointError(msg) from e


def _transformer_config(root: Path, folder: str = TRANSFORMER) -> tuple[dict[str, Any], Any]:
    """Parsed `folder`/config.json and diffusers' model built from it on meta (shapes, no memory)."""
    from diffusers import MiniMaxH3Transformer3DModel

    rel = f"{folder}/config.json"
    config = read_json(root, rel)
    if not isinstance(config, dict):
        raise CheckpointError(f"{rel}: expected a JSON object")
    if config.get("_class_name", TRANSFORMER_CLASS) != TRANSFORMER_CLASS:
        raise CheckpointError(f"{rel}: _class_name is {config['_class_name']!r}, expected '{TRANSFORMER_CLASS}'")
    try:
        with torch.device("meta"):
            model = MiniMaxH3Transformer3DModel.from_config(config)
    except Exception as e:  # diffusers raises whatever the constructor raises on a bad value
        raise CheckpointError(f"{rel}: cannot build {TRANSFORMER_CLASS}: {type(e).__name__}: {e}") from e
    return config, model


def _weight_map(root: Path, folder: str = TRANSFORMER) -> dict[str, str]:
    """Tensor -> shard file (bare name) of `folder`/, from its index or its single file."""
    rel_index = f"{folder}/{INDEX_FILE}"
    if not (root / rel_index).is_file():
        if not (root / folder / SINGLE_FILE).is_file():
            raise CheckpointError(f"{folder}/: holds neither {INDEX_FILE} nor {SINGLE_FILE}")
        hdr = _header(root, f"{folder}/{SINGLE_FILE}")
        return dict.fromkeys(hdr.tensors, SINGLE_FILE)
    data = read_json(root, rel_index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{rel_index}: corrupt index: weight_map must map tensor names to shard file names")
    for tname, fname in weight_map.items():
        if fname != Path(fname).name or not fname.endswith(".safetensors"):
            raise CheckpointError(f"{rel_index}: tensor '{tname}' names an invalid shard file {fname!r}")
    return weight_map


def _transformer_headers(
    root: Path, weight_map: Mapping[str, str], folder: str = TRANSFORMER
) -> dict[str, ShardHeader]:
    """Relative shard path -> parsed header; index <-> shard files checked both ways."""
    rel_index = f"{folder}/{INDEX_FILE}"
    headers: dict[str, ShardHeader] = {}
    for fname in sorted(set(weight_map.values())):
        rel = f"{folder}/{fname}"
        first = next(t for t, f in weight_map.items() if f == fname)
        if not (root / rel).is_file():
            raise CheckpointError(f"{rel_index}: tensor '{first}' points to missing shard {rel}")
        headers[rel] = _header(root, rel, first)
    for path in sorted((root / folder).glob("*.safetensors")):
        rel = f"{folder}/{path.name}"
        if rel not in headers:
            hdr = _header(root, rel)
            some = next(iter(sorted(hdr.tensors)), "<none>")
            raise CheckpointError(f"{rel}: shard not named by {INDEX_FILE} (it holds tensor '{some}')")
    return headers


def _stored_dtype(
    expected: Iterable[str], entries: Mapping[str, tuple[str, str]], keep: list[str], folder: str = TRANSFORMER
) -> str:
    """The repository's dtype outside `_keep_in_fp32_modules`: the most common one among those tensors."""
    votes = Counter(
        entries[n][1] for n in expected if n in entries and load_dtype(n, torch.bfloat16, keep) != torch.float32
    )
    if not votes:
        raise CheckpointError(f"{folder}/: no tensor outside _keep_in_fp32_modules to read the stored dtype from")
    dtype = votes.most_common(1)[0][0]
    if dtype not in _PROJECTION_DTYPES:
        name = next(n for n in sorted(expected) if n in entries and entries[n][1] == dtype)
        raise CheckpointError(
            f"{entries[name][0]}: tensor '{name}': stored dtype {dtype}; allowed {sorted(_PROJECTION_DTYPES)}"
        )
    return dtype


def _check_tensors(
    model: Any,
    weight_map: Mapping[str, str],
    headers: Mapping[str, ShardHeader],
    require_adaln: bool,
    listing: str,
    folder: str = TRANSFORMER,
) -> tuple[torch.dtype, bool]:
    """Every state-dict tensor present with its shape and dtype; none unexpected. Returns (stored dtype, has_adaln).

    `listing` is the file that lists the tensors (the index, or the single safetensors file), named when one is absent.
    """
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    keep = list(model._keep_in_fp32_modules or [])
    entries: dict[str, tuple[str, str]] = {}  # tensor -> (relative shard, safetensors dtype)
    for tname, fname in weight_map.items():
        rel = f"{folder}/{fname}"
        if tname not in shapes:
            raise CheckpointError(f"{rel}: unexpected tensor '{tname}' for this transformer config")
        entry = headers[rel].tensors.get(tname)
        if entry is None:
            raise CheckpointError(f"{rel}: missing tensor '{tname}' (the index says it is here)")
        if entry.shape != shapes[tname]:
            raise CheckpointError(
                f"{rel}: tensor '{tname}': wrong shape {list(entry.shape)}, expected {list(shapes[tname])}"
            )
        entries[tname] = (rel, entry.dtype)
    stored = _stored_dtype(shapes, entries, keep, folder)
    has_adaln = all(n in entries for n in shapes if is_plan_tensor(n))
    for tname, shape in shapes.items():
        want = _ST_NAMES[load_dtype(tname, _PROJECTION_DTYPES[stored], keep)]
        if tname not in entries:
            if is_plan_tensor(tname) and not require_adaln:
                continue
            raise CheckpointError(f"{listing}: missing tensor '{tname}' (expected {want}{list(shape)})")
        rel, dtype = entries[tname]
        if dtype != want:
            raise CheckpointError(
                f"{rel}: tensor '{tname}': wrong dtype {dtype}, expected {want} (stored dtype {stored}, _keep_in_fp32_modules in F32)"
            )
    return _PROJECTION_DTYPES[stored], has_adaln


def _other_headers(root: Path, files: Iterable[str], done: Mapping[str, ShardHeader]) -> dict[str, ShardHeader]:
    """Headers of every safetensors file outside transformer/ (text encoder, VAEs), bounds-checked."""
    return {rel: _header(root, rel) for rel in files if rel.endswith(".safetensors") and rel not in done}


def _check_json(root: Path, files: Iterable[str]) -> None:
    for rel in files:
        if rel.endswith(".json"):
            read_json(root, rel)


def validate_checkpoint(path: str | Path, require_adaln: bool = True) -> CheckpointInfo:
    """Check a MiniMax-H3 diffusers repository; raise CheckpointError naming the file (and tensor) on any fault.

    `require_adaln=False` is the cached-mode check: the plan tensors may be absent from the transformer's shards
    (a cached generator never reads them), but any that are present must still be well-formed.
    """
    root = Path(path)
    components = _components(root)
    found: dict[str, tuple[dict[str, Any], PageLayout, torch.dtype, bool]] = {}
    headers: dict[str, ShardHeader] = {}
    for name, folder in PARTITIONS.items():
        if folder not in components:
            continue
        config, model = _transformer_config(root, folder)
        weight_map = _weight_map(root, folder)
        shards = _transformer_headers(root, weight_map, folder)
        indexed = (root / folder / INDEX_FILE).is_file()
        listing = f"{folder}/{INDEX_FILE if indexed else SINGLE_FILE}"
        dtype, has_adaln = _check_tensors(model, weight_map, shards, require_adaln, listing, folder)
        found[name] = (config, PageLayout.from_config(config), dtype, has_adaln)
        headers.update(shards)
    files = repository_files(root, components)
    _check_json(root, files)
    headers = {**headers, **_other_headers(root, files, headers)}
    digests = {rel: file_digest(root, rel, headers.get(rel)) for rel in files}
    partitions = {
        name: PartitionInfo(
            name, PARTITIONS[name], config, layout, dtype, has_adaln, partition_fingerprint(digests, name)
        )
        for name, (config, layout, dtype, has_adaln) in found.items()
    }
    base = partitions[BASE]
    for other in partitions.values():
        if other.name != BASE and (other.layout, other.projection_dtype) != (base.layout, base.projection_dtype):
            raise CheckpointError(
                f"{other.folder}/config.json: its plan pages ({other.layout.page_numel} elements in "
                f"{other.projection_dtype}) differ from {base.folder}/'s ({base.layout.page_numel} in "
                f"{base.projection_dtype}); both partitions' plans share one slab, so their layouts must match"
            )
    return CheckpointInfo(
        root,
        base.transformer_config,
        base.layout,
        base.projection_dtype,
        base.has_adaln,
        digests,
        combine_digests(digests),
        partitions,
    )
