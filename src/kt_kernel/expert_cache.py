"""``mmap_experts_dir``: a directory of packed experts that later launches map instead of packing.

The first ``load_weights()`` of a layer packs it as always, then writes each engine's (each
subpool's) packed experts to a file of the directory; a later load with the same key maps that file
read-only and the engine computes from its pages (src/core/packed_file.h): no packing, no anonymous
copy, and processes mapping one file share its pages. The key names everything the packed bytes
depend on (layer_key); a file that is not what its name promises is packed and written again, with a
RuntimeWarning, never used as weights. docs/expert-cache.md tells the rest.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import secrets
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ._native import ext
from .gguf_file import gguf_files, is_gguf_checkpoint, open_gguf

#: Bump when the key or the meta bytes change (the packed layout has ext.PACKED_FILE_VERSION).
CACHE_VERSION = 1
#: Set (not 0) to check every mapped file's weights against their checksum (a read of the file).
VERIFY_ENV = "KT_KERNEL_MMAP_VERIFY"
#: The cache directory of wrappers built without ``mmap_experts_dir``: how a serving stack that does
#: not pass the keyword (SGLang's integration files) turns the cache on.
DIR_ENV = "KT_KERNEL_MMAP_EXPERTS_DIR"
SUFFIX = ".ktpacked"
#: A safetensors header longer than this is digested by its first bytes only (the load refuses it).
_MAX_HEADER_BYTES = 100 << 20
_HASH_CHUNK = 1 << 20


def open_cache(value: object) -> ExpertCache | None:
    """KTMoEWrapper's ``mmap_experts_dir`` (None: the DIR_ENV variable, where set and not empty),
    checked: None (no cache), or the directory (made if missing). A path that is not a directory is
    refused; one that cannot be made warns and gives no cache (the layers are packed into anonymous
    memory, as without one)."""
    if value is None:
        value = os.environ.get(DIR_ENV) or None
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"mmap_experts_dir must be a path (str or os.PathLike), got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise ValueError("mmap_experts_dir must be a non-empty str path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "mmap_experts_dir must be a directory, not a file", text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        warnings.warn(
            f"mmap_experts_dir {text!r} cannot be made ({error}): experts are packed into anonymous memory",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return ExpertCache(path)


def _file_digest(file: Path, start: int, stop: int) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            chunk = f.read(min(left, _HASH_CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _header_end(file: Path) -> int:
    """Where a file's header ends: safetensors' 8 + its length, GGUF's tensor data offset, the whole
    of anything else (JSON: a manifest, an index, a config)."""
    size = file.stat().st_size
    if file.suffix == ".safetensors":
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
        return min(size, 8 + length) if length <= _MAX_HEADER_BYTES else min(size, 8)
    if file.suffix == ".gguf":
        try:
            return min(size, int(open_gguf(file).data_offset))
        except Exception:  # a bad file: the load says why; its first bytes tell it apart meanwhile
            return min(size, _HASH_CHUNK)
    return size


@functools.lru_cache(maxsize=4096)
def _identity(file: str, size: int, mtime_ns: int, version: tuple[int, ...]) -> tuple[str, int, int, str]:
    """Memoized per file version (device, inode, ctime: a rewrite with the old mtime put back is
    another version), so that each layer's key does not read every header again."""
    return file, size, mtime_ns, _file_digest(Path(file), 0, _header_end(Path(file)))


def source_identity(weight_path: str | Path) -> list[tuple[str, int, int, str]]:
    """Each file of the checkpoint: (path, size, mtime_ns, digest of its header bytes). The files:
    a GGUF model's (its split set), else the directory's .safetensors, .gguf and .json files (every
    layer's files: a change to any invalidates every layer), or the file given."""
    path = Path(weight_path).resolve()
    if is_gguf_checkpoint(path):
        files = list(gguf_files(path))
    elif path.is_dir():
        kinds = (".safetensors", ".gguf", ".json")
        files = sorted(f for f in path.iterdir() if f.suffix in kinds and f.is_file())
    else:
        files = [path]
    identities = []
    for file in files:
        status = file.stat()
        identities.append(
            _identity(
                str(file),
                status.st_size,
                status.st_mtime_ns,
                (status.st_dev, status.st_ino, status.st_ctime_ns),
            )
        )
    return identities


@functools.lru_cache(maxsize=1)
def code_identity() -> dict[str, Any]:
    """This installation: the build bound, its packed-file layout version, its module file and a
    digest of the package's Python code (quantize-on-load, the readers): an upgrade invalidates."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for file in sorted(package.rglob("*.py")):
        digest.update(str(file.relative_to(package)).encode() + b"\0" + file.read_bytes())
    module = Path(ext.__file__)
    status = module.stat()
    return {
        "build": ext.VARIANT,
        "layout_version": ext.PACKED_FILE_VERSION,
        "module": [module.name, status.st_size, status.st_mtime_ns],
        "python": digest.hexdigest(),
    }


def layer_key(weights: Any, weight_path: str, method: str, slots: torch.Tensor) -> dict[str, Any]:
    """Everything a layer's packed files depend on: the code, the source files, the layer, its
    format and method, shapes and quantize-on-load group sizes, the experts in each slot
    (``slots``: -1 where an expert is left out of CPU memory), and the subpool split."""
    fmt = weights.format
    groups = [fmt.choose_group(weights.hidden), fmt.choose_group(weights.inter)] if fmt.group_scales else None
    return {
        "cache_version": CACHE_VERSION,
        "code": code_identity(),
        "sources": [list(i) for i in source_identity(weight_path)],
        "layer": weights.layer_idx,
        "format": fmt.name,
        "method": method,
        "experts": weights.num_experts,
        "hidden": weights.hidden,
        "intermediate": weights.inter,
        "quantize_groups": groups,
        "slots": [int(s) for s in slots],
        "subpools": [[sp.start, sp.stop] for sp in weights.subpools],
    }


def _open_lock(path: Path) -> int | None:
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (made if missing); without one where it cannot be opened (a
    read-only directory: nothing is written there, so nothing needs one)."""
    fd = _open_lock(path)
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=6)  # the caller of load_weights


def _remove(file: Path) -> None:
    try:
        file.unlink(missing_ok=True)
    except OSError:  # a read-only directory: the file stays, and is checked again next time
        pass


class ExpertCache:
    """One mmap_experts_dir: loads layers through it (load)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def files(self, key: dict[str, Any], count: int) -> tuple[str, list[Path], Path]:
        """The key's digest, each subpool's file and the layer's lock file."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        stem = f"layer{key['layer']:04d}-{key['format'].lower()}-{digest[:32]}"
        files = [self.directory / f"{stem}-{i}of{count}{SUFFIX}" for i in range(count)]
        return digest, files, self.directory / f"{stem}.lock"

    def load(self, weights: Any, weight_path: str, slot_map: torch.Tensor, gpu_mask: torch.Tensor,
             method: str, read: Callable[[], None]) -> None:  # fmt: skip
        """Layer ``weights`` mapped from the cache where its files are good, else ``read()`` (the
        load from the checkpoint) and its files written for the next time."""
        slots = torch.where(gpu_mask, -1, slot_map) if weights.skip_gpu_copy else slot_map
        key = layer_key(weights, weight_path, method, slots)
        digest, files, lock = self.files(key, len(weights.subpools))
        with _locked(lock):
            for file in files:  # a writer that died under the lock left these
                for stale in file.parent.glob(file.name + ".tmp*"):
                    _remove(stale)
            if all(f.exists() for f in files) and self._map(weights, files, digest, slot_map, gpu_mask):
                return
            read()
            self._write(weights, files, digest)

    def _map(self, weights: Any, files: list[Path], digest: str, slot_map: torch.Tensor,
             gpu_mask: torch.Tensor) -> bool:  # fmt: skip
        verify = os.environ.get(VERIFY_ENV, "0") not in ("", "0")
        weights.start(gpu_mask)
        metas = []
        for sp, file in zip(weights.subpools, files, strict=True):
            reason, raw = sp.engine.map_packed(str(file), verify)
            meta = self._meta(raw) if not reason else None
            if not reason and (meta is None or meta.get("key") != digest):
                reason = "written for another key"
            if reason:
                _warn(f"mmap_experts_dir: {file} cannot be used ({reason}): packing the layer again")
                _remove(file)
                weights.start(gpu_mask)  # engines mapped before this one go back to packing
                return False
            metas.append(meta)
        weights.adopt_mapped(metas[0], slot_map)
        return True

    @staticmethod
    def _meta(raw: bytes) -> dict | None:
        try:
            meta = json.loads(raw)
        except ValueError:
            return None
        return meta if isinstance(meta, dict) else None

    def _write(self, weights: Any, files: list[Path], digest: str) -> None:
        meta = json.dumps(
            {"key": digest, "scale_groups": weights.scale_groups, "zero_points": weights.zero_points}
        ).encode()
        for sp, file in zip(weights.subpools, files, strict=True):
            temporary = file.with_name(f"{file.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
            try:
                sp.engine.save_packed(str(temporary), meta)
                os.replace(temporary, file)
            except (OSError, RuntimeError) as error:
                _remove(temporary)
                _warn(
                    f"mmap_experts_dir: cannot write {file} ({error}): layer {weights.layer_idx} stays in "
                    "anonymous memory and is packed again at the next launch"
                )
                return
