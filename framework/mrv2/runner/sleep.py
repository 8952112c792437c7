"""Sleep mode: an idle engine gives its device memory back, and takes it again on waking
(vLLM's ``LLM.sleep`` / ``wake_up``: an RL trainer shares the GPUs between rollouts and
training).

Memory is given back storage by storage: each storage is resized to nothing and, on waking,
back to its size, as FSDP frees parameters. Every tensor and view that shares a storage (tied
weights, a drafter's bound KV caches, a layer's derived views) therefore sees the memory come
back, and no reference needs to be found and replaced. What is kept is copied to one flat host
buffer, pinned when the device is CUDA. What is discarded comes back zeroed (never as
uninitialized memory, whose NaNs a masked attention read would spread).

The memory comes back at other addresses, so the runner drops its CUDA graphs at sleep and
captures them again once everything is awake. A storage that cannot be resized (a CPU KV
cache that maps anonymous pages) stays where it is, as it is: its stale blocks are as safe as a
used block's, and zeroing them would touch pages the cache never used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["LEVELS", "TAGS", "Sleeper", "Stash", "check_level", "check_tags",
           "module_storages"]

logger = logging.getLogger(__name__)

#: What sleeps and wakes apart (vLLM's tags): the weights (every module's parameters and
#: buffers) and the KV cache.
TAGS = ("weights", "kv_cache")
#: Level 1 keeps the weights in host memory; level 2 discards the model's parameters too.
LEVELS = (1, 2)


def check_level(level: object) -> None:
    """ValueError unless ``level`` is one of :data:`LEVELS`."""
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """``tags`` checked (None: all of :data:`TAGS`), in :data:`TAGS`' order: ValueError
    naming the field and the allowed values."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = [tags]
    asked = list(tags)
    bad = [tag for tag in asked if tag not in TAGS]
    if bad or not asked:
        raise ValueError(f"tags must be a non-empty subset of {list(TAGS)} (or None: all), "
                         f"got {asked!r}")
    return tuple(tag for tag in TAGS if tag in asked)


def _tensors_of(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """A module's own tensors: parameters, buffers, and tensors it keeps as attributes (or in
    a list or tuple attribute), such as the derived weights a layer makes after loading."""
    yield from (t for t in module._parameters.values() if t is not None)
    yield from (t for t in module._buffers.values() if t is not None)
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _modules_of(root: object) -> Iterable[torch.nn.Module]:
    """``root``'s modules: all of them for a module, else those of the modules among its
    attributes (a speculator's drafter, a ModelState's encoder)."""
    if isinstance(root, torch.nn.Module):
        yield from root.modules()
        return
    for value in vars(root).values() if hasattr(root, "__dict__") else ():
        if isinstance(value, torch.nn.Module):
            yield from value.modules()


def module_storages(roots: Iterable[object], device: torch.device,
                    exclude: Iterable[torch.UntypedStorage] = ()
                    ) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages on ``device`` of every tensor of ``roots``' modules
    (:func:`_modules_of`), less ``exclude``'s."""
    seen = {s.data_ptr() for s in exclude}
    storages = []
    for root in roots:
        for module in _modules_of(root):
            for tensor in _tensors_of(module):
                storage = tensor.untyped_storage()
                if not _on(tensor, device) or storage.nbytes() == 0:
                    continue
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    storages.append(storage)
    return storages


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (
        device.index is None or tensor.device.index == device.index)


def tensor_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages of ``tensors``."""
    by_ptr = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return [s for s in by_ptr.values() if s.nbytes() > 0]


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (nbytes,), (1,))


@dataclass
class Stash:
    """Storages put to sleep together (one tag's): what they held, kept in ``host`` where
    ``keep`` said so, and how to bring them back (:meth:`wake`)."""

    storages: list[torch.UntypedStorage]
    sizes: list[int]
    #: Each storage's place in :attr:`host` (None: discarded, zeroed on waking).
    offsets: list[int | None]
    host: torch.Tensor | None
    #: The storages that were resized to nothing (the others stayed: not resizable).
    freed: list[bool] = field(default_factory=list)
    pinned: bool = False

    @classmethod
    def put_to_sleep(cls, storages: list[torch.UntypedStorage],
                     keep: Callable[[torch.UntypedStorage], bool]) -> Stash:
        """Copy the storages ``keep`` names to host memory, then free every storage that can
        be resized. The device must be idle (no graph, no kernel reading them)."""
        sizes = [s.nbytes() for s in storages]
        offsets: list[int | None] = []
        total = 0
        for storage, size in zip(storages, sizes, strict=True):
            offsets.append(total if keep(storage) else None)
            total += size if offsets[-1] is not None else 0
        cuda = any(s.device.type == "cuda" for s in storages)
        host = _page_aligned(total) if total else None
        stash = cls(storages, sizes, offsets, host)
        if host is not None and cuda:
            stash.pinned = _pin(host)
        for storage, size, offset in zip(storages, sizes, offsets, strict=True):
            if offset is not None and host is not None:
                host[offset:offset + size].copy_(_bytes_view(storage, size),
                                                 non_blocking=stash.pinned)
        if cuda:
            torch.cuda.synchronize()
        for storage in storages:
            resizable = storage.resizable()
            if resizable:
                storage.resize_(0)
            stash.freed.append(resizable)
        return stash

    @property
    def freed_bytes(self) -> int:
        """Device bytes given back."""
        return sum(size for size, freed in zip(self.sizes, self.freed, strict=True) if freed)

    @property
    def kept_bytes(self) -> int:
        """Bytes copied to host memory."""
        return 0 if self.host is None else int(self.host.numel())

    def wake(self) -> None:
        """Give every storage its memory back, then its kept bytes (or zeros). If the device
        has no room, the storages given memory so far are freed again and the error raised:
        the stash stays asleep and can wake later."""
        grown: list[torch.UntypedStorage] = []
        try:
            for storage, size, freed in zip(self.storages, self.sizes, self.freed,
                                            strict=True):
                if freed:
                    storage.resize_(size)
                    grown.append(storage)
        except BaseException:
            for storage in grown:
                storage.resize_(0)
            raise
        cuda = False
        for storage, size, offset, freed in zip(self.storages, self.sizes, self.offsets,
                                                self.freed, strict=True):
            cuda = cuda or storage.device.type == "cuda"
            if offset is not None and self.host is not None:
                _bytes_view(storage, size).copy_(self.host[offset:offset + size],
                                                 non_blocking=self.pinned)
            elif freed:  # (one that stayed holds what it held: finite values)
                _bytes_view(storage, size).zero_()
        if cuda:
            torch.cuda.synchronize()
        self.drop()

    def drop(self) -> None:
        """Let the host copies go (after :meth:`wake`, or when the runner shuts down)."""
        if self.pinned and self.host is not None:
            _unpin(self.host)
        self.host = None


def _page_aligned(nbytes: int, page: int = 4096) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page boundary (what ``cudaHostRegister``
    locks whole pages of)."""
    buffer = torch.empty(nbytes + page, dtype=torch.uint8)
    start = -buffer.data_ptr() % page
    return buffer[start:start + nbytes]


def _pin(host: torch.Tensor) -> bool:
    """Page-lock ``host`` in place (``cudaHostRegister``: the exact size, where a pinned
    allocation would round up to a power of two and stay in torch's host cache). False, and
    the copies go through pageable memory, when the driver refuses."""
    started = time.perf_counter()
    try:
        code = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    except Exception as error:  # (a build without the binding)
        logger.warning("sleep: host memory not pinned (%s); the copies will be slower", error)
        return False
    if int(code) != 0:
        logger.warning("sleep: cudaHostRegister of %.2f GiB failed (error %s); the copies "
                       "will be slower", host.numel() / (1 << 30), int(code))
        return False
    logger.debug("sleep: pinned %.2f GiB of host memory in %.2f s", host.numel() / (1 << 30),
                 time.perf_counter() - started)
    return True


def _unpin(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


class Sleeper:
    """What of one runner is asleep, by tag (:data:`TAGS`), and how it wakes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stashes: dict[str, Stash] = {}

    @property
    def asleep(self) -> tuple[str, ...]:
        """The tags asleep, in :data:`TAGS`' order (empty: awake)."""
        return tuple(tag for tag in TAGS if tag in self._stashes)

    @property
    def sleeping(self) -> bool:
        """Whether any tag is asleep."""
        return bool(self._stashes)

    def check(self, level: int) -> None:
        """ValueError for a ``level`` not in :data:`LEVELS`; RuntimeError when already
        asleep (checked before anything is dropped)."""
        check_level(level)
        if self._stashes:
            raise RuntimeError(f"already asleep ({', '.join(self.asleep)}): wake_up() first")

    def sleep(self, level: int, roots: Iterable[object], params: Iterable[torch.Tensor],
              kv_tensors: Iterable[torch.Tensor]) -> None:
        """Put every tensor of ``roots``' modules (:func:`module_storages`) and the KV caches
        to sleep: the weights copied to host memory (at ``level`` 2 only those that are not
        in ``params``), the KV caches discarded. The device must be idle."""
        self.check(level)
        started = time.perf_counter()
        kv = tensor_storages(kv_tensors)
        weights = module_storages(roots, self.device, exclude=kv)
        discard = {s.data_ptr() for s in tensor_storages(params)} if level == 2 else set()
        self._stashes["weights"] = Stash.put_to_sleep(
            weights, lambda s: s.data_ptr() not in discard)
        self._stashes["kv_cache"] = Stash.put_to_sleep(kv, lambda s: False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        w, k = self._stashes["weights"], self._stashes["kv_cache"]
        logger.info("sleep (level %d): %.2f GiB of weights freed (%.2f GiB kept in host "
                    "memory), %.2f GiB of KV cache freed, in %.2f s", level,
                    w.freed_bytes / _GIB, w.kept_bytes / _GIB, k.freed_bytes / _GIB,
                    time.perf_counter() - started)

    def wake(self, tags: Iterable[str] | None = None) -> bool:
        """Wake ``tags`` (None: all; :func:`check_tags`); those already awake are left as
        they are. True when nothing is asleep any more."""
        for tag in check_tags(tags):
            stash = self._stashes.get(tag)
            if stash is not None:
                started = time.perf_counter()
                stash.wake()
                del self._stashes[tag]
                logger.info("wake_up: %s back (%.2f GiB) in %.2f s", tag,
                            stash.freed_bytes / _GIB, time.perf_counter() - started)
        return not self._stashes

    def release(self) -> None:
        """Drop every stash's host copies: the runner shuts down asleep."""
        for stash in self._stashes.values():
            stash.drop()
        self._stashes.clear()


_GIB = float(1 << 30)
