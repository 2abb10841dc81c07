"""Checkpoint tensors read when asked: a Mapping of HF names whose values are read from the file
(or cut from a tensor in memory) on each access and kept by nobody.

The model copies each tensor straight into its parameter (on the device, in the serving dtype)
and drops it, so loading holds one checkpoint tensor on the host at a time. A safetensors read
opens the file's memory map for that one tensor and closes it again: a map held open for the
whole load would count every page read so far in the process's resident set. `part` cuts a
tensor parallel rank's slice through safetensors' get_slice, reading only the slice's rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

Index = tuple[slice, ...]
"""A slice per leading dimension (() is the whole tensor)."""


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    read: Callable[[Index], torch.Tensor]
    """The tensor, or the part an Index selects, in the checkpoint's dtype on the host."""


class LazyWeights(Mapping[str, torch.Tensor]):
    def __init__(self, entries: dict[str, Entry]):
        self._entries = entries

    @classmethod
    def over(cls, tensors: Mapping[str, torch.Tensor]) -> LazyWeights:
        """Tensors already in memory (a GGUF's dequantized ones), behind the same interface."""
        if isinstance(tensors, LazyWeights):
            return tensors
        return cls({n: Entry(tuple(t.shape), partial(cut_tensor, t)) for n, t in tensors.items()})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._entries[name].read(())

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def part(self, name: str, index: Index, rows: int | None = None) -> Entry:
        """An Entry for `index` of this tensor, zero rows appended up to `rows` (a vocabulary
        padded to a multiple of the ranks); nothing is read until the Entry is."""
        e = self._entries[name]
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, e.shape))
        shape += e.shape[len(shape):]
        pad = 0 if rows is None else rows - shape[0]
        read = partial(_read_part, e.read, index, pad)
        return Entry(((rows,) + shape[1:]) if rows is not None else shape, read)


def cut_tensor(t: torch.Tensor, index: Index) -> torch.Tensor:
    return t[index].contiguous() if index else t


def _read_part(read: Callable[[Index], torch.Tensor], index: Index, pad: int,
               sub: Index) -> torch.Tensor:
    if sub:
        raise ValueError("a part of a part is not read")
    t = read(index)
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad > 0 else t


def safetensors_entries(path: str) -> dict[str, Entry]:
    """Every tensor of a safetensors file; only the header is read here (safe_open checks it
    against the file's size, so a truncated or garbled file fails now, not mid-load)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {name: Entry(tuple(f.get_slice(name).get_shape()),
                            partial(_read_safetensors, path, name)) for name in f.keys()}


def _read_safetensors(path: str, name: str, index: Index) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        s = f.get_slice(name)
        return s[index] if index else s[:]
