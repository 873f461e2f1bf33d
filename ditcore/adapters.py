"""Adapters (LoRA files) as ditserve serves them: what one file is (`read_adapter` -> `AdapterInfo`: its identity,
rank, targets grouped as trunk / modulation / time embedder, partition and contract), the directory of them
(`AdapterRegistry`, `--adapter-dir`), and the adapters loaded into one model (`ModelAdapters`: diffusers' own loader
puts them in PEFT layers; a request activates its own with PEFT's `set_adapters(names, weights)`, a request without
any runs with every adapter disabled, which is the base model's computation exactly).

An adapter is any `*.safetensors` file of the directory, named by its stem, in a layout diffusers' MiniMax-H3 loader
converts (`MiniMaxH3LoraLoaderMixin.lora_state_dict`: diffusers, ai-toolkit, musubi-tuner, kohya, DiffSynth). Its
contract (ditcore.adapter_contract) comes from `NAME.json` beside it, else from the file's `__metadata__` entry
`ditserve_contract`. Its identity is the sha256 of the file's bytes and the canonical contract: a file that changes
under its name is read again (size, mtime or inode moved) and gets a new identity; what was loaded under the old one
is never served for it again (loaded adapters are keyed by identity).

A cached model (ditcore.plans: `adaln_proj` and `norm_out` read plans) serves trunk-only adapters on the base plans,
and an adapter that changes the modulation (`adaln_proj`, `norm_out` or the time embedder) only where its plans are
built with it (`RunOptions.adapter_plans`: the generator's sidecar builds them, ditcore.adapter_plans): its trunk
part then goes into PEFT layers, the rest is in its plans. Without that it is refused (`AdapterError`, naming the
adapter and its modulation targets), never served on base plans.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .adapter_contract import (
    METADATA_KEY,
    NAME,
    AdapterContract,
    AdapterError,
    AdapterNotFoundError,
    ManifestError,
)
from .adapter_files import DELTA_SUFFIXES, adapter_modules, delta_modules, group_of
from .request import GenerationRequest, RequestError

GROUPS = ("trunk", "modulation", "time")
MODULATION_GROUPS = ("modulation", "time")
"""Targets that change what a plan holds (adaln_proj / norm_out, and the time embedding they read)."""
_PREFIXES = {"transformer.": "base", "transformer_ref.": "ref"}


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter file as read."""

    name: str
    path: Path
    identity: str
    """sha256 of the file's bytes and its canonical contract (hex)."""
    size_bytes: int
    rank: int
    """The largest LoRA rank of its modules."""
    partition: str
    """"base" (transformer) or "ref" (transformer_ref)."""
    targets: dict[str, tuple[str, ...]]
    """Its modules (diffusers' names) by group: "trunk", "modulation", "time"."""
    contract: AdapterContract
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    """Each module's (in_features, out_features) as its factors and deltas say (lora_A's columns, lora_B's rows, a
    weight delta's shape; in_features 0 when only a bias delta says anything)."""
    deltas: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)
    """The modules it changes by full-parameter deltas (`.diff` / `.diff_b`) and which of their parameters
    ("weight", "bias")."""
    numel: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    """Per group: (LoRA factor elements, full-parameter delta bytes as stored): what loading it holds."""
    stat: tuple[Any, ...] = field(default=(), compare=False)
    """The file's and its manifest's (size, mtime_ns, inode) when read: an adapter whose stat moved is read again."""

    @property
    def changes_modulation(self) -> bool:
        """It targets adaln_proj / norm_out or the time embedder: a plan is a function of it too."""
        return any(self.targets.get(g) for g in MODULATION_GROUPS)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "identity": self.identity, "rank": self.rank, "partition": self.partition,
                "bytes": self.size_bytes, "targets": {g: len(self.targets.get(g, ())) for g in GROUPS},
                "contract": self.contract.to_dict()}  # fmt: skip


def _stat(path: Path) -> tuple[Any, ...]:
    """The file's (size, mtime_ns, inode) and its manifest's (or None): OSError when the file is gone."""
    st = os.stat(path)
    manifest = path.with_suffix(".json")
    try:
        ms = os.stat(manifest)
        mine: tuple[int, int, int] | None = (ms.st_size, ms.st_mtime_ns, ms.st_ino)
    except OSError:
        mine = None
    return (st.st_size, st.st_mtime_ns, st.st_ino, mine)


_DELTA_PREFIXES = {"transformer.": "base", "transformer_ref.": "ref", "diffusion_model.": "base"}


def read_deltas(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], set[str], list[str]]:
    """The full-parameter deltas of an adapter file, as diffusers' modules' (module -> {"weight" | "bias": delta},
    as stored), the partitions they name, and the delta keys that name no module ditserve serves."""
    from safetensors import safe_open

    deltas: dict[str, dict[str, torch.Tensor]] = {}
    partitions, stray = set(), []
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
            suffix = next((x for x in DELTA_SUFFIXES if key.endswith(x)), None)
            if suffix is None:
                continue
            name = key.removesuffix(suffix)
            prefix = next((p for p in _DELTA_PREFIXES if name.startswith(p)), "")
            converted = delta_modules(name.removeprefix(prefix), f.get_tensor(key))
            if converted is None:
                stray.append(key)
                continue
            partitions.add(_DELTA_PREFIXES.get(prefix, "base"))
            for module, delta in converted.items():
                deltas.setdefault(module, {})[DELTA_SUFFIXES[suffix]] = delta
    return deltas, partitions, stray


def has_deltas(path: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return any(k.endswith(tuple(DELTA_SUFFIXES)) for k in f.keys())  # noqa: SIM118


@contextmanager
def lora_file(path: Path) -> Iterator[Path | None]:
    """The adapter's LoRA part as a file diffusers' loader reads: the file itself when it holds no full-parameter
    deltas, else a temporary copy without them (its `alpha` / `format` metadata kept, so diffusers scales it the
    same); None when it holds no LoRA factors at all."""
    from safetensors import safe_open

    if not has_deltas(path):
        yield path
        return
    with safe_open(str(path), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(tuple(DELTA_SUFFIXES))}  # noqa: SIM118
        metadata = dict(f.metadata() or {})
    if not kept:
        yield None
        return
    with _part_file(kept, metadata, path.name) as part:
        yield part


@contextmanager
def _part_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str], name: str) -> Iterator[Path]:
    """A part of an adapter (`tensors`) as a temporary safetensors file diffusers' loader reads, with the whole
    file's `alpha` / `format` metadata (so diffusers scales it as it scales the whole); removed after."""
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="ditserve-adapter-") as tmp:
        part = Path(tmp) / name
        save_file(tensors, str(part), metadata={k: v for k, v in metadata.items() if k in ("alpha", "format")})
        yield part


def lora_state(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The adapter's LoRA factors as diffusers' H3 loader converts them (diffusers' names, `transformer.` /
    `transformer_ref.` prefixed) and the LoRA metadata it derives (its alpha): empty for a deltas-only file."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    with lora_file(path) as part:
        if part is None:
            return {}, None
        state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(part), return_lora_metadata=True)
    return state, metadata


def read_adapter(path: Path) -> AdapterInfo:
    """Read one adapter file (and its manifest): AdapterError naming the file when it is not one diffusers' H3 loader
    converts, carries non-finite factors or deltas, keys that name no LoRA factor or delta of a module ditserve
    serves, or a broken manifest."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    name = path.stem
    if path.suffix != ".safetensors" or not NAME.fullmatch(name):
        raise AdapterError(f"{path.name}: an adapter is NAME.safetensors, NAME 1-128 of A-Z a-z 0-9 . _ -")
    stat = _stat(path)
    try:
        with safe_open(str(path), "pt") as f:
            file_metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{path.name}: not a safetensors file ({e})") from None
    manifest = path.with_suffix(".json")
    try:
        if manifest.is_file():
            contract = AdapterContract.parse(manifest.read_text(), manifest.name)
        elif METADATA_KEY in file_metadata:
            contract = AdapterContract.parse(file_metadata[METADATA_KEY], f"{path.name} __metadata__ {METADATA_KEY}")
        else:
            contract = AdapterContract()
    except ManifestError as e:
        raise AdapterError(str(e)) from None
    try:
        deltas, partitions, stray = read_deltas(path)
        state, _ = lora_state(path)
    except Exception as e:  # diffusers' converter: a layout it does not know, a key it cannot map
        raise AdapterError(f"{path.name}: diffusers' MiniMax-H3 LoRA loader refuses it: {e}") from None
    targets: dict[str, set[str]] = {g: set() for g in GROUPS}
    numel = {g: [0, 0] for g in GROUPS}
    ranks: list[int] = []
    ins: dict[str, int] = {}
    outs: dict[str, int] = {}
    for key, tensor in state.items():
        prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
        module, _, kind = key.removeprefix(prefix or "").rpartition(".lora_")
        if prefix is None or not kind or kind not in ("A.weight", "B.weight"):
            stray.append(key)
            continue
        group = group_of(module)
        if group is None:
            stray.append(key)
            continue
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{path.name}: {key} holds NaN or Inf")
        partitions.add(_PREFIXES[prefix])
        targets[group].add(module)
        numel[group][0] += tensor.numel()
        if kind == "A.weight":
            ranks.append(int(tensor.shape[0]))
            ins[module] = int(tensor.shape[-1])
        else:
            outs[module] = int(tensor.shape[0])
    for module, params in deltas.items():
        group = group_of(module)
        assert group is not None  # delta_modules maps onto grouped modules only
        targets[group].add(module)
        numel[group][1] += sum(d.numel() * d.element_size() for d in params.values())
        for param, delta in params.items():
            if not torch.isfinite(delta).all():
                raise AdapterError(f"{path.name}: the {param} delta of {module} holds NaN or Inf")
        weight, bias = params.get("weight"), params.get("bias")
        if (weight is not None and weight.ndim != 2) or (bias is not None and bias.ndim != 1):
            raise AdapterError(f"{path.name}: {module}'s deltas are not a (out, in) weight and an (out,) bias")
        fan_in = int(weight.shape[1]) if weight is not None else 0
        fan_out = int(weight.shape[0]) if weight is not None else int(bias.shape[0]) if bias is not None else 0
        if weight is not None and bias is not None and bias.shape[0] != fan_out:
            raise AdapterError(f"{path.name}: {module}'s weight delta has {fan_out} rows but its bias delta "
                               f"{bias.shape[0]}")  # fmt: skip
        if module in outs and (outs[module] != fan_out or (fan_in and ins.get(module, fan_in) != fan_in)):
            raise AdapterError(f"{path.name}: {module}'s LoRA factors and full-parameter deltas disagree on its shape")
        ins[module] = ins.get(module) or fan_in
        outs[module] = fan_out
    if stray:
        raise AdapterError(
            f"{path.name}: {len(stray)} key(s) name no LoRA factor or full-parameter delta of a MiniMax-H3 module "
            f"ditserve serves (e.g. {', '.join(sorted(stray)[:3])}): nothing is loaded"
        )
    if not ranks and not deltas:
        raise AdapterError(f"{path.name}: no LoRA factors or full-parameter deltas")
    partition = contract.partition or (partitions.pop() if len(partitions) == 1 else "")
    if len(partitions) > 1 or not partition:
        raise AdapterError(f"{path.name}: targets both transformer partitions; an adapter targets one")
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(b"\0" + contract.canonical().encode())
    shapes = {m: (ins.get(m, 0), outs.get(m, 0)) for m in set(ins) | set(outs)}
    return AdapterInfo(name, path, h.hexdigest(), stat[0], max(ranks, default=0), partition,
                       {g: tuple(sorted(m)) for g, m in targets.items()}, contract, shapes,
                       deltas={m: tuple(sorted(p)) for m, p in deltas.items()},
                       numel={g: (a, b) for g, (a, b) in numel.items()}, stat=stat)  # fmt: skip


class AdapterRegistry:
    """The adapters of one directory (`--adapter-dir`), read when first asked for and again when their file moved."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._known: dict[str, AdapterInfo] = {}
        self._lock = threading.Lock()  # requests, ListAdapters and admission read it from several threads

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.safetensors") if NAME.fullmatch(p.stem))

    def get(self, name: str) -> AdapterInfo:
        """The adapter `name`, its file read again if it changed. AdapterNotFoundError, AdapterError."""
        if not NAME.fullmatch(name):
            raise AdapterNotFoundError(f"adapter {name!r}: not an adapter name (no path, 1-128 of A-Z a-z 0-9 . _ -)")
        path = self.root / f"{name}.safetensors"
        try:
            stat = _stat(path)
        except OSError:
            self._known.pop(name, None)
            raise AdapterNotFoundError(f"adapter {name}: no {name}.safetensors in the adapter directory") from None
        with self._lock:
            known = self._known.get(name)
            if known is None or known.stat != stat:
                known = read_adapter(path)
                self._known[name] = known
            return known

    def contracts(self, names: Iterable[str]) -> list[tuple[str, AdapterContract]]:
        """(name, contract) of each named adapter that can be read now, in order: what
        ditcore.adapter_contract.contract_defaults reads. One that cannot be read (not a name, unknown, refused)
        gives none: admission refuses it, naming why."""
        out = []
        for name in names:
            try:
                out.append((name, self.get(name).contract))
            except (AdapterError, AdapterNotFoundError):
                continue
        return out

    def scan(self) -> tuple[list[AdapterInfo], dict[str, str]]:
        """Every adapter of the directory, and the refusal of each file that is not one (name -> message)."""
        found, errors = [], {}
        for name in self.names():
            try:
                found.append(self.get(name))
            except (AdapterError, AdapterNotFoundError) as e:
                errors[name] = str(e)
        return found, errors


def with_delta(param: torch.Tensor, delta: torch.Tensor, scale: float) -> torch.Tensor:
    """A full-parameter delta applied as its producers define it: the parameter plus `scale` x the delta, the delta
    cast to the parameter's dtype and device first (as ComfyUI applies `.diff` / `.diff_b` at a strength)."""
    return param + delta.to(device=param.device, dtype=param.dtype) * scale


class ModelAdapters:
    """The adapters loaded into one model's transformers, keyed by identity (diffusers' `load_lora_weights` into PEFT
    layers), at most `max_loaded` of them holding at most `max_loaded_bytes` (the least recently used is deleted
    first)."""

    def __init__(self, model: Any, registry: AdapterRegistry | None = None, max_loaded: int = 8,
                 max_loaded_bytes: int = 8 << 30) -> None:  # fmt: skip
        self.model = model
        self.registry = registry
        """Where a request's adapter names are found (--adapter-dir); None: this model serves none."""
        self.max_loaded = max_loaded
        self.max_loaded_bytes = max_loaded_bytes
        """What the loaded adapters may hold on the model's device together (`held_bytes`); the least recently used
        are deleted until a new one fits, and one that alone exceeds it is refused."""
        self._held: dict[str, int] = {}
        """PEFT name -> the bytes it holds (measured when it was loaded)."""
        self._lock = threading.Lock()
        """Guards the loaded set for readers on other threads (GetStatus, ListAdapters, admission); the model's one
        executor is its only writer."""
        self._loaded: OrderedDict[str, AdapterInfo] = OrderedDict()
        self._fits: set[str] = set()
        """Identities whose factors were found to fit this model's modules (check_servable)."""
        self._deltas: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        """PEFT name -> its full-parameter deltas this model applies itself (module -> parameter -> delta), on the
        module's device: all of them resident, the trunk's in cached mode (the rest is in its plans)."""
        self._modulation_shapes: dict[str, dict[str, tuple[int, int]]] = {}
        self.modulation_plans = False
        """A cached model whose plan provider builds plans with adapters (the sidecar: plan keys carry their digest):
        it then serves modulation-changing adapters too, their trunk part in PEFT layers, the rest in its plans."""

    def resolve(self, request: GenerationRequest) -> list[tuple[AdapterInfo, float]]:
        """The request's adapters as read now, each at its scale: AdapterNotFoundError for a name the directory
        lacks, RequestError for a contract or partition the request breaks, AdapterError for a file this model
        cannot serve (a modulation adapter on cached plans)."""
        if not request.adapters:
            return []
        out = []
        for use in request.adapters:
            if self.registry is None:
                raise AdapterNotFoundError(f"adapter {use.name}: this server serves no adapters (no --adapter-dir)")
            info = self.registry.get(use.name)
            info.contract.check(info.name, float(use.scale), request.task, request.num_inference_steps,
                                request.flow_shift, request.audio_flow_shift)  # fmt: skip
            if info.partition != request.partition:
                raise RequestError(
                    "adapters", f"adapter {info.name} targets the {info.partition} transformer ("
                    f"{'ref2va' if info.partition == 'ref' else 't2va and fl2va'}); a {request.task} request runs "
                    f"the {request.partition} one",
                )  # fmt: skip
            self.check_servable(info)
            out.append((info, float(use.scale)))
        return out

    def check_servable(self, info: AdapterInfo) -> None:
        """AdapterError unless this model can serve `info`: every targeted module exists with the factors' shapes (a
        LoRA trained on a pruned checkpoint does not fit); on a cached model modulation targets only where its plans
        are built with them (`modulation_plans`)."""
        transformer = self.model.transformers().get(info.partition)
        if transformer is not None and info.identity not in self._fits:
            modules = dict(transformer.named_modules())
            planned = self._planned_shapes(info.partition, transformer) if self.model.mode == "cached" else {}
            for module, (fan_in, fan_out) in sorted(info.shapes.items()):
                base = modules.get(module)
                base = getattr(base, "base_layer", base)  # a module PEFT already wraps
                if module in planned:  # not in a cached transformer: its plans hold it, shaped as the config says
                    have_in, have_out = planned[module]
                elif isinstance(base, torch.nn.Linear):
                    have_in, have_out = base.in_features, base.out_features
                    if "bias" in info.deltas.get(module, ()) and base.bias is None:
                        raise AdapterError(f"adapter {info.name}: {module} has no bias for its bias delta")
                else:
                    raise AdapterError(f"adapter {info.name}: {module} is not a linear layer of this model")
                if (have_in if fan_in else 0, have_out) != (fan_in, fan_out):
                    raise AdapterError(
                        f"adapter {info.name}: {module} is {have_in} -> {have_out} in this model but its factors are "
                        f"{fan_in or '?'} -> {fan_out} (trained on other shapes, e.g. a pruned checkpoint)"
                    )
            self._fits.add(info.identity)  # a model's shapes never change: checked once per identity
        need = self.load_bytes(info)
        if need > self.max_loaded_bytes:
            raise AdapterError(
                f"adapter {info.name}: loading it holds {need:,} bytes, more than the {self.max_loaded_bytes:,} all "
                "loaded adapters may hold (--max-loaded-adapter-mb)"
            )
        if info.changes_modulation and self.model.mode == "cached" and not self.modulation_plans:
            mods = ", ".join((*info.targets["modulation"], *info.targets["time"])[:4])
            raise AdapterError(
                f"adapter {info.name} changes the modulation ({mods}, ...): cached mode serves it only on plans built "
                "with it; serve it in resident mode"
            )

    def _planned_shapes(self, partition: str, transformer: Any) -> dict[str, tuple[int, int]]:
        """A cached transformer's modulation and time-embedder linears as its config shapes them (module ->
        (in, out)): they are not in the model, but their plans are built from them."""
        if partition not in self._modulation_shapes:
            units = adapter_modules(dict(transformer.config), MODULATION_GROUPS)
            self._modulation_shapes[partition] = {t: (u.in_features, u.out_features) for u in units for t in u.targets}
        return self._modulation_shapes[partition]

    def load_bytes(self, info: AdapterInfo) -> int:
        """What loading `info` holds on the model's device (0 once loaded): its LoRA factors at the transformer's
        dtype (PEFT makes them its base layers'), its deltas as stored; a cached model holds only the trunk's (its
        plans hold the rest)."""
        if self.peft_name(info) in self._loaded:
            return 0
        transformer = self.model.transformers().get(info.partition)
        total = 0
        for group in ("trunk",) if self.model.mode == "cached" else GROUPS:
            factors, deltas = info.numel.get(group, (0, 0))
            size = 2
            if factors and transformer is not None:  # the dtype of the group's layers (the time embedder's: float32)
                layer = transformer.get_submodule(info.targets[group][0])
                size = getattr(layer, "base_layer", layer).weight.element_size()
            total += factors * size + deltas
        return total

    def pending_bytes(self, uses: Sequence[tuple[AdapterInfo, float]]) -> int:
        """What loading a request's adapters would add (those not loaded yet), for the memory admission."""
        return sum(self.load_bytes(info) for info in {i.identity: i for i, _ in uses}.values())

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @staticmethod
    def peft_name(info: AdapterInfo) -> str:
        return f"a{info.identity[:24]}"

    def loaded(self) -> list[AdapterInfo]:
        with self._lock:
            return list(self._loaded.values())

    def loaded_bytes(self) -> dict[str, int]:
        """identity -> bytes it holds in the model (its PEFT factors and its deltas, measured when it was loaded)."""
        with self._lock:
            return {info.identity: self._held.get(name, 0) for name, info in self._loaded.items()}

    def _measure(self, name: str) -> int:
        """The bytes the loaded adapter `name` holds: its PEFT parameters in every transformer, and its deltas."""
        held = sum(param.numel() * param.element_size() for transformer in self.model.transformers().values()
                   for pname, param in transformer.named_parameters() if f".{name}." in pname)  # fmt: skip
        deltas = self._deltas.get(name, {})
        return held + sum(d.numel() * d.element_size() for p in deltas.values() for d in p.values())

    def load(self, info: AdapterInfo) -> str:
        """Load `info` now (as a request's first use would: checked, least recently used evicted past `max_loaded`):
        its PEFT name. AdapterError when it cannot be served; nothing of it stays loaded then."""
        return self._ensure(info)

    def unload(self, name: str) -> AdapterInfo | None:
        """Delete the loaded adapter named `name` (the file's stem) from the model: what was loaded, None when no
        adapter of that name is loaded. Call it between requests (a running request holds its adapters active)."""
        with self._lock:
            peft_name = next((k for k, v in self._loaded.items() if v.name == name), None)
        return None if peft_name is None else self._drop(peft_name)

    def _ensure(self, info: AdapterInfo) -> str:
        name = self.peft_name(info)
        if name in self._loaded:
            with self._lock:
                self._loaded.move_to_end(name)
            return name
        self.check_servable(info)
        need = self.load_bytes(info)
        while self._loaded and (
            len(self._loaded) >= self.max_loaded or self.held_bytes() + need > self.max_loaded_bytes
        ):
            self._drop(next(iter(self._loaded)))
        try:
            if self.model.mode == "cached" and info.changes_modulation:
                self._load_trunk_part(info, name)
            elif info.rank:  # it has LoRA factors (a deltas-only file has none)
                with lora_file(info.path) as part:
                    self.model.pipe.load_lora_weights(str(part), adapter_name=name,
                                                      load_into_transformer_ref=info.partition == "ref")  # fmt: skip
            deltas = self._load_deltas(info)
        except Exception as e:  # diffusers / PEFT refused it: nothing of it stays loaded
            with contextlib.suppress(Exception):
                self.model.pipe.delete_adapters(name)
            raise AdapterError(f"adapter {info.name}: diffusers' loader refused it: {e}") from None
        try:
            moved = _stat(info.path) != info.stat
        except OSError:
            moved = True
        if moved:  # replaced while it loaded: what was read may not be the file its identity names
            with contextlib.suppress(Exception):
                self.model.pipe.delete_adapters(name)
            raise AdapterError(f"adapter {info.name}: its file changed while it was loading; send the request again")
        with self._lock:
            self._deltas[name] = deltas
            self._loaded[name] = info
            self._held[name] = self._measure(name)
        return name

    def _drop(self, name: str) -> AdapterInfo:
        """Forget the loaded adapter `name` (PEFT name): its PEFT layers (a plan-only one never entered the model)
        and its deltas."""
        with self._lock:
            info = self._loaded.pop(name)
            self._deltas.pop(name, None)
            self._held.pop(name, None)
        if any(name in getattr(t, "peft_config", {}) for t in self.model.transformers().values()):
            self.model.pipe.delete_adapters(name)
        return info

    def _load_deltas(self, info: AdapterInfo) -> dict[str, dict[str, torch.Tensor]]:
        """The full-parameter deltas this model applies itself, each on its module's device (a cached model: only
        the trunk's; the sidecar builds the rest into plans)."""
        if not info.deltas:
            return {}
        transformer = self.model.transformer_of(info.partition)
        deltas, _, _ = read_deltas(info.path)
        out = {}
        for module, params in deltas.items():
            if self.model.mode == "cached" and group_of(module) in MODULATION_GROUPS:
                continue
            layer = transformer.get_submodule(module)
            device = getattr(layer, "base_layer", layer).weight.device
            out[module] = {p: d.to(device) for p, d in params.items()}
        return out

    def _load_trunk_part(self, info: AdapterInfo, name: str) -> None:
        """A cached model holds no adaln_proj, norm_out or (used) time embedder: only the adapter's trunk factors go
        into PEFT layers (its plans carry the rest). Written as diffusers' own layout with the file's metadata (its
        alpha), and loaded through diffusers' loader like any file."""
        from safetensors import safe_open

        trunk = set(info.targets["trunk"])
        state, _ = lora_state(info.path)
        kept = {k: v.contiguous() for k, v in state.items() if k.split(".", 1)[1].rpartition(".lora_")[0] in trunk}
        if not kept:
            return  # nothing of its LoRA runs in the model itself
        with safe_open(str(info.path), "pt") as f:
            metadata = dict(f.metadata() or {})
        with _part_file(kept, metadata, info.path.name) as part:
            self.model.pipe.load_lora_weights(str(part), adapter_name=name,
                                              load_into_transformer_ref=info.partition == "ref")  # fmt: skip

    @contextmanager
    def active(self, partition: str, uses: Sequence[tuple[AdapterInfo, float]]) -> Iterator[None]:
        """The request's adapters (in its order, at its scales) active on the `partition` transformer meanwhile; every
        adapter disabled after, and for a request without any."""
        transformer = self.model.transformer_of(partition)
        for info, _ in uses:
            if info.partition != partition:
                raise AdapterError(
                    f"adapter {info.name} targets the {info.partition} transformer; this request runs the {partition} one"
                )
        loaded = [(self._ensure(info), scale) for info, scale in uses]
        in_model = [(n, s) for n, s in loaded if n in getattr(transformer, "peft_config", {})]  # not plan-only ones
        has_peft = bool(getattr(transformer, "peft_config", None))
        try:
            if in_model:
                transformer.enable_lora()
                transformer.set_adapters([n for n, _ in in_model], [float(s) for _, s in in_model])
            elif has_peft:
                transformer.disable_lora()
            with self._deltas_applied(transformer, loaded):
                yield
        finally:
            if getattr(transformer, "peft_config", None):
                transformer.disable_lora()

    @contextmanager
    def _deltas_applied(self, transformer: Any, loaded: Sequence[tuple[str, float]]) -> Iterator[None]:
        """Each adapter's full-parameter deltas added to its modules' parameters meanwhile, in the request's order
        (`with_delta`); the very tensors they held before put back after."""
        saved: dict[tuple[str, str], torch.Tensor] = {}
        layers: dict[str, Any] = {}
        try:
            for name, scale in loaded:
                for module, params in self._deltas.get(name, {}).items():
                    layer = layers.setdefault(module, getattr(transformer.get_submodule(module), "base_layer", None)
                                              or transformer.get_submodule(module))  # fmt: skip
                    for pname, delta in params.items():
                        param = getattr(layer, pname)
                        saved.setdefault((module, pname), param.data)
                        param.data = with_delta(param.data, delta, float(scale))
            yield
        finally:
            for (module, pname), data in saved.items():
                getattr(layers[module], pname).data = data
