"""The expert store: the directory ``hetmoe convert`` writes, and the reader the runtime loads it with.

Layout of a store directory::

    hetmoe.json                       the manifest, written last: without it a store is incomplete
    hetmoe-progress.json              the progress journal; exists only while a conversion runs or
                                      after one was interrupted (``--resume`` reads it)
    experts-L{layer:03d}.safetensors  one per MoE layer: that layer's routed experts, stacked [E, ...]
    model-rest.safetensors            every other tensor under its source name, in its source precision
                                      (model-rest-00001-of-00003.safetensors, ... past the shard size)
    config.json, tokenizer files ...  copied from the source (from a GGUF: config.json rebuilt from its
                                      metadata, see ``hetmoe.checkpoint.config.config_from_gguf``)

In a layer file every projection is the codec's tensors under ``{layer prefix}experts.{projection}``:
``model.layers.3.experts.gate.weight`` + ``...gate.weight_scale`` (int4/int8), ``...down.qweight`` +
``.qzeros`` + ``.scales`` + ``.g_idx`` (gptq), ``...up_blocks`` + ``...up_scales`` (mxfp4); logical shapes
are gate/up ``[E, I, H]`` and down ``[E, H, I]`` (the codecs' ``[..., N, K]``). Expert biases (gpt-oss,
some GGUF files) are ``...experts.{projection}.bias`` ``[E, N]`` in their source dtype. The file's
``__metadata__`` repeats the layer, method and codec parameters so a file is self-describing.

GGUF sources keep their non-expert tensors as GGUF tensors: each is stored as its raw ggml bytes,
``uint8 [*logical_shape[:-1], row_bytes]`` (what ``GGUFFile.get`` returns), and the file's
``__metadata__["gguf_tensors"]`` maps its name to ``[ggml type, logical shape]``; this reader hands
those tensors out exactly like ``GGUFFile`` does (``info().dtype`` is the ggml type name). The GGUF
key/value metadata (tokenizer vocabulary, chat template) is not copied: keep the original file for it.

Safetensors files here are written by :func:`write_safetensors`, which streams one tensor at a time
(so writing never holds more than one tensor beyond what the caller holds) and is deterministic:
the same tensors give the same bytes, which is what lets an interrupted conversion be resumed into a
store identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats import FormatError, QuantizedTensor, get_codec
from ..formats.registry import UnknownMethodError
from .atomic import SequentialWriter
from .config import read_json_object
from .errors import CheckpointError
from .experts import PROJECTIONS, LayerExperts
from .layout import MoELayout
from .quant_config import ExpertScheme
from .safetensors_file import DTYPE_NAMES, SafetensorsFile, TensorInfo

STORE_FORMAT = "hetmoe-expert-store"
STORE_VERSION = 1
MANIFEST = "hetmoe.json"
JOURNAL = "hetmoe-progress.json"
JOURNAL_FORMAT = "hetmoe-expert-store-progress"
LAYER_FILE_FORMAT = "hetmoe-experts"
REST_FORMAT = "hetmoe-rest"
EXPERTS_MODULE = "experts"
GGUF_TENSORS_KEY = "gguf_tensors"
_LAYER_FILE = re.compile(r"^experts-L(?P<layer>\d{3,})\.safetensors$")
# Bytes handed to the writer and the hash at a time: small enough to stay in cache between the two.
_WRITE_CHUNK = 8 << 20


def layer_file_name(layer: int) -> str:
    return f"experts-L{layer:03d}.safetensors"


def rest_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model-rest.safetensors"]
    return [f"model-rest-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def expert_prefix(layer_prefix: str, projection: str) -> str:
    """The module name of one projection's stacked experts in a layer file."""
    return f"{layer_prefix}{EXPERTS_MODULE}.{projection}"


def is_store_dir(path: Path) -> bool:
    """A complete store, an interrupted conversion, or stray layer files: never a plain checkpoint."""
    if not path.is_dir():
        return False
    if (path / MANIFEST).exists() or (path / JOURNAL).exists():
        return True
    return any(_LAYER_FILE.match(p.name) for p in path.glob("experts-L*.safetensors"))


# --- streaming, deterministic safetensors writer ------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to write: its header entry is known up front, its data is fetched when written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fetch: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> PlannedTensor:
        return cls(name, tensor.dtype, tuple(tensor.shape), lambda: tensor)


@dataclass(frozen=True)
class WrittenFile:
    bytes: int
    sha256: str


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_safetensors(path: Path, tensors: Iterable[PlannedTensor], metadata: dict[str, str]) -> WrittenFile:
    """Write a safetensors file one tensor at a time; returns its size and sha256.

    Tensors are laid out by element size (largest first) then name, as the reference writer does,
    so every tensor starts at a multiple of its element size; the header is padded with spaces to
    8 bytes. Same tensors and metadata in, same bytes out.
    """
    ordered = sorted(tensors, key=lambda t: (-_itemsize(t.dtype), t.name))
    names = [t.name for t in ordered]
    if len(set(names)) != len(names):
        raise FormatError(path.name, "unique tensor names", f"{len(names) - len(set(names))} repeated")
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for t in ordered:
        if t.dtype not in DTYPE_NAMES:
            raise FormatError(t.name, f"a dtype safetensors stores: {sorted(DTYPE_NAMES.values())}", str(t.dtype))
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    head = struct.pack("<Q", len(raw)) + raw
    # Each piece is hashed on a second thread while it is written (both release the GIL), so a
    # layer written while nothing else runs takes the time of the slower of the two, not their sum.
    with SequentialWriter(path) as f, ThreadPoolExecutor(1, thread_name_prefix="hetmoe-hash") as hasher:
        f.write(head)
        digest.update(head)
        for t in ordered:
            data = t.fetch()
            if data.dtype != t.dtype or tuple(data.shape) != t.shape:
                raise FormatError(t.name, f"{t.dtype} {list(t.shape)} as planned", f"{data.dtype} {list(data.shape)}")
            flat = data.contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), _WRITE_CHUNK):
                piece = flat[start : start + _WRITE_CHUNK]
                hashed = hasher.submit(digest.update, piece.numpy().data)
                f.write(piece)
                hashed.result()
            del data, flat
    return WrittenFile(len(head) + offset, digest.hexdigest())


# --- layer files --------------------------------------------------------------------------------


def layer_metadata(layer: int, method: str, params: dict[str, Any]) -> dict[str, str]:
    return {
        "format": LAYER_FILE_FORMAT,
        "store_version": str(STORE_VERSION),
        "layer": str(layer),
        "method": method,
        "params": json.dumps(params, sort_keys=True),
    }


def layer_tensors(experts: LayerExperts, layer_prefix: str) -> list[PlannedTensor]:
    """A layer's tensors under their store names, ready for :func:`write_safetensors`."""
    out: list[PlannedTensor] = []
    for proj, q in experts.projections.items():
        out += [PlannedTensor.of(k, t) for k, t in q.state_dict(expert_prefix(layer_prefix, proj)).items()]
    for proj, bias in experts.biases.items():
        out.append(PlannedTensor.of(expert_prefix(layer_prefix, proj) + ".bias", bias))
    return out


@dataclass(frozen=True)
class LayerSpec:
    """What one layer file must hold: enough to validate it without a manifest (used on resume too)."""

    layer: int
    layer_prefix: str
    method: str
    params: dict[str, Any]
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}


def check_layer_header(path: Path | SafetensorsFile, spec: LayerSpec) -> SafetensorsFile:
    """Open a layer file (or take it opened) and check its metadata and tensor names against ``spec``
    (no data read)."""
    f = path if isinstance(path, SafetensorsFile) else SafetensorsFile(path)
    path = f.path
    meta = f.metadata
    want = layer_metadata(spec.layer, spec.method, spec.params)
    for key in ("format", "layer", "method", "params"):
        if meta.get(key) != want[key]:
            raise CheckpointError(path, f"layer file metadata {key!r}: expected {want[key]!r}, found {meta.get(key)!r}")
    codec = get_codec(spec.method, **spec.params)
    expected = [
        expert_prefix(spec.layer_prefix, proj) + s.suffix
        for proj, shape in spec.shapes().items()
        for s in codec.tensor_specs(shape)
    ]
    missing = [k for k in expected if k not in f]
    if missing:
        raise CheckpointError(path, f"layer {spec.layer}: missing tensors {missing[:5]} ({len(missing)} in all)")
    biases = {expert_prefix(spec.layer_prefix, p) + ".bias" for p in PROJECTIONS}
    extra = [k for k in f.keys() if k not in expected and k not in biases]
    if extra:
        raise CheckpointError(path, f"layer {spec.layer}: unexpected tensors {extra[:5]} for {codec.label()}")
    return f


def read_layer_file(path: Path | SafetensorsFile, spec: LayerSpec) -> LayerExperts:
    """One layer file as ``LayerExperts`` in the store's method, every tensor validated: views of the
    file's one mapping (so that what ``populate`` or ``prefetch`` read in is what the engine uses)."""
    f = check_layer_header(path, spec)
    path = f.path
    codec = get_codec(spec.method, **spec.params)
    out: dict[str, QuantizedTensor] = {}
    biases: dict[str, torch.Tensor | None] = {}
    for proj, shape in spec.shapes().items():
        base = expert_prefix(spec.layer_prefix, proj)
        tensors = {s.suffix: f.get(base + s.suffix) for s in codec.tensor_specs(shape)}
        q = QuantizedTensor(spec.method, shape, tensors, codec.params)
        try:
            codec.validate(q, base)
        except FormatError as exc:
            raise CheckpointError(path, str(exc)) from exc
        out[proj] = q
        biases[proj] = _bias(f, base + ".bias", shape[:2], path)
    return LayerExperts(spec.layer, out["gate"], out["up"], out["down"], biases["gate"], biases["up"], biases["down"])


def _bias(f: SafetensorsFile, name: str, shape: tuple[int, int], path: Path) -> torch.Tensor | None:
    if name not in f:
        return None
    info = f.info(name)
    if not (isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point) or info.shape != shape:
        raise CheckpointError(
            path, f"tensor {name}: expected a float bias {list(shape)}, found {info.dtype} {info.shape}"
        )
    t = f.get(name)
    if not bool(torch.isfinite(t.float()).all()):
        raise CheckpointError(path, f"tensor {name}: expected finite values, found NaN/Inf")
    return t


# --- the reader -----------------------------------------------------------------------------------


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """A store side file's JSON object, checked as config.read_json_object checks one; ``what`` names it."""
    try:
        return read_json_object(path)
    except CheckpointError as exc:
        raise CheckpointError(path, f"cannot read the {what}: it {exc.problem}") from None


def open_store(path: str | Path) -> ExpertStore:
    """The store at ``path``; an interrupted or damaged one is an error that says what is missing."""
    return ExpertStore(path)


def incomplete_error(d: Path) -> CheckpointError:
    """Why a directory without a manifest is not a usable store, naming the layers still missing."""
    journal_path = d / JOURNAL
    on_disk = sorted(int(m["layer"]) for p in d.glob("experts-L*.safetensors") if (m := _LAYER_FILE.match(p.name)))
    if not journal_path.exists():
        return CheckpointError(
            d,
            f"incomplete hetmoe expert store: no {MANIFEST} and no {JOURNAL}; layer files found for layers "
            f"{on_disk[:20]}; convert again with --overwrite",
        )
    try:
        journal = read_json_file(journal_path, "progress journal")
        planned = [int(x) for x in journal["plan"]["moe_layers"]]
        done_files = set(journal["done"])
        plan = journal["plan"]
        command = resume_command(plan["source"]["path"], d, plan["method"], plan["params"])
    except (KeyError, TypeError, ValueError, CheckpointError):
        return CheckpointError(d, f"incomplete hetmoe expert store: no {MANIFEST} and an unreadable {JOURNAL}")
    finished = [layer for layer in planned if layer_file_name(layer) in done_files]
    missing = [layer for layer in planned if layer_file_name(layer) not in done_files]
    return CheckpointError(
        d,
        f"incomplete hetmoe expert store (the conversion was interrupted, no {MANIFEST}): "
        f"{len(finished)} of {len(planned)} MoE layers finished, missing layers {_short(missing)}; "
        f"finish it with: {command}",
    )


def resume_command(source: Any, store: Path, method: Any, params: Any) -> str:
    """The command line that finishes or repairs ``store``, for error messages."""
    group = params.get("group_size") if isinstance(params, dict) and method in ("int4", "int4-asym", "gptq") else None
    return (
        f"hetmoe convert {source} {store} --method {method}" + (f" --group-size {group}" if group else "") + " --resume"
    )


def _short(layers: list[int], limit: int = 16) -> str:
    shown = ", ".join(str(x) for x in layers[:limit])
    return f"[{shown}{', ...' if len(layers) > limit else ''}] ({len(layers)})"


class ExpertStore:
    """A complete expert store: ``layer(L) -> LayerExperts`` and a ``TensorSource`` over all its tensors.

    Opening checks the manifest and that every file it lists is present with its recorded size;
    ``layer(L)`` opens that layer's file afresh (nothing stays mapped between layers) and validates
    every tensor. ``keys()/info()/get()`` see expert and non-expert tensors alike under their store
    names, so ``open_source(store)`` works wherever a checkpoint does, and ``moe_layout()`` says where
    the experts are for ``read_layer_experts``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).exists():
            raise incomplete_error(self.path)
        self.manifest = read_json_file(self.path / MANIFEST, "store manifest")
        m = self.manifest
        where = self.path / MANIFEST
        if m.get("format") != STORE_FORMAT:
            raise CheckpointError(where, f"not a hetmoe expert store manifest (format {m.get('format')!r})")
        if m.get("version") != STORE_VERSION:
            raise CheckpointError(
                where, f"store version {m.get('version')!r} is not supported (expected {STORE_VERSION})"
            )
        try:
            self.method: str = m["method"]
            if not isinstance(self.method, str):
                raise TypeError(f"method must be a string, found {self.method!r}")
            self.params: dict[str, Any] = dict(m["params"])
            arch = m["architecture"]
            self.prefix: str = arch["prefix"]
            self.num_layers = int(arch["num_layers"])
            self.moe_layers: tuple[int, ...] = tuple(int(x) for x in arch["moe_layers"])
            self.num_experts = int(arch["num_experts"])
            self.top_k = int(arch["top_k"])
            self.hidden_size = int(arch["hidden_size"])
            self.intermediate_size = int(arch["intermediate_size"])
            self.model_type: str = arch["model_type"]
            self._layers: dict[int, dict[str, Any]] = {int(r["layer"]): r for r in m["layers"]}
            self._rest: list[dict[str, Any]] = list(m["rest"])
            # File names are fixed by the layout: a manifest cannot point the reader anywhere else.
            expected = [layer_file_name(x) for x in sorted(self._layers)] + rest_file_names(len(self._rest))
            for rec, name in zip(self._layer_records() + self._rest, expected, strict=True):
                if rec["file"] != name or not isinstance(rec["bytes"], int):
                    raise ValueError(f"file record {rec!r}, expected file {name!r} with an integer size")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(where, f"malformed store manifest: {type(exc).__name__}: {exc}"[:500]) from None
        try:
            self.codec = get_codec(self.method, **self.params)
        except (UnknownMethodError, FormatError, TypeError) as exc:
            raise CheckpointError(where, f"store method {self.method!r} {self.params}: {exc}") from None
        if sorted(self._layers) != sorted(self.moe_layers):
            raise CheckpointError(
                where, f"manifest lists layer files {sorted(self._layers)} for MoE layers {self.moe_layers}"
            )
        self._check_files()
        self._files = [SafetensorsFile(self.path / r["file"]) for r in self._layer_records() + self._rest]
        self._where: dict[str, SafetensorsFile] = {}
        self._gguf: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in self._files:
            for name in f.keys():
                if name in self._where:
                    raise CheckpointError(f.path, f"tensor {name!r} also appears in {self._where[name].path.name}")
                self._where[name] = f
            raw = f.metadata.get(GGUF_TENSORS_KEY)
            if raw:
                try:
                    types = json.loads(raw)
                    self._gguf.update({n: (str(t), tuple(int(d) for d in s)) for n, (t, s) in types.items()})
                except (ValueError, TypeError) as exc:
                    raise CheckpointError(f.path, f"malformed {GGUF_TENSORS_KEY} metadata: {exc}") from None

    def _layer_records(self) -> list[dict[str, Any]]:
        return [self._layers[layer] for layer in sorted(self._layers)]

    def _check_files(self) -> None:
        """Every listed file present with its recorded size; otherwise name the layers (and files) missing."""
        missing, wrong = [], []
        for rec in self._layer_records() + self._rest:
            p = self.path / rec["file"]
            if not p.exists():
                missing.append(rec)
            elif p.stat().st_size != rec["bytes"]:
                wrong.append(rec)
        if not missing and not wrong:
            return
        problems = []
        for what, recs in (("missing", missing), ("truncated or altered (size differs from the manifest)", wrong)):
            layers = [r["layer"] for r in recs if "layer" in r]
            others = [r["file"] for r in recs if "layer" not in r]
            if layers:
                problems.append(f"layers {_short(layers)} {what}")
            if others:
                problems.append(f"{others} {what}")
        recorded = self.manifest.get("source")  # where it was converted from, for the repair command
        source = recorded.get("path", "SRC") if isinstance(recorded, dict) else "SRC"
        command = resume_command(source, self.path, self.method, self.params)
        raise CheckpointError(
            self.path, f"damaged hetmoe expert store: {'; '.join(problems)}; repair it with: {command}"
        )

    # --- experts ---------------------------------------------------------------------------------

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}.{layer}."

    def layer_spec(self, layer: int) -> LayerSpec:
        if layer not in self._layers:
            raise CheckpointError(
                self.path, f"layer {layer} is not an MoE layer of this store (MoE layers: {list(self.moe_layers)})"
            )
        return LayerSpec(
            layer,
            self.layer_prefix(layer),
            self.method,
            self.params,
            self.num_experts,
            self.hidden_size,
            self.intermediate_size,
        )

    def layer(self, layer: int) -> LayerExperts:
        """Layer ``layer``'s experts in the store's method, validated."""
        spec = self.layer_spec(layer)
        file = self._layers[layer]["file"]
        return read_layer_file(next(f for f in self._files if f.path.name == file), spec)

    def layer_keys(self, layer: int) -> list[str]:
        """The names of one layer's expert tensors, as ``keys()`` lists them."""
        self.layer_spec(layer)  # a clear error for a layer that is not an MoE layer
        file = self._layers[layer]["file"]
        return [name for name, f in self._where.items() if f.path.name == file]

    def moe_layout(self, config: dict[str, Any] | None = None) -> MoELayout:
        """The store's experts as a ``MoELayout`` (style ``"store"``), checked against ``config`` if given."""
        if config is not None:
            for key, mine in (("hidden_size", self.hidden_size), ("num_hidden_layers", self.num_layers)):
                if key in config and config[key] != mine:
                    raise CheckpointError(
                        config.get("_source", self.path / "config.json"),
                        f"{key}={config[key]} but the store's manifest says {mine}",
                    )
        return MoELayout(
            model_type=self.model_type,
            prefix=self.prefix,
            num_layers=self.num_layers,
            moe_layers=self.moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            style="store",
            gate=f"{EXPERTS_MODULE}.gate",
            up=f"{EXPERTS_MODULE}.up",
            down=f"{EXPERTS_MODULE}.down",
            scheme=ExpertScheme(self.method, dict(self.codec.params), {}, MANIFEST),
            config_source=str(self.path / "config.json"),
            keys=frozenset(self._where),
        )

    # --- TensorSource ----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        f = self._file(name)
        info = f.info(name)
        if name in self._gguf:  # raw ggml blocks: described like GGUFFile describes them
            ggml_type, shape = self._gguf[name]
            return TensorInfo(name, ggml_type, shape, info.nbytes, f.path)
        return info

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get(name)

    def prefetch(self, name: str) -> None:
        """Start reading the tensor's bytes into the page cache (SafetensorsFile.prefetch)."""
        self._file(name).prefetch(name)

    def populate(self, name: str) -> None:
        """Read the tensor's bytes into memory now (SafetensorsFile.populate)."""
        self._file(name).populate(name)
