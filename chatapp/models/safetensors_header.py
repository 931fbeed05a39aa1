"""A safetensors file's header, read without torch or the safetensors library: what `chatapp models` counts and
what the check of a prepared model compares with the file's size, at every start, in microseconds."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A header this large is no model's: refused before it is read.
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    header_bytes: int
    file_bytes: int

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(entry["shape"]) for entry in self.tensors.values())

    @property
    def described_bytes(self) -> int:
        """The file size the header describes: the length prefix, the header and the end of the last tensor."""
        end = max((entry["data_offsets"][1] for entry in self.tensors.values()), default=0)
        return 8 + self.header_bytes + end


def read_header(path: Path) -> SafetensorsHeader:
    """The header of the safetensors file `path`, opened as a regular file without blocking (`store.open_regular`:
    a FIFO is refused, `DataDirError`). ValueError when it has no readable header (too short, a length past its
    end, not a JSON object)."""
    from chatapp import store

    with store.open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is truncated ({size} bytes)")
        length = int.from_bytes(head, "little")
        if not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path.name} is truncated (its header claims {length} bytes, the file has {size})")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} has no safetensors header")
    header.pop("__metadata__", None)
    return SafetensorsHeader(tensors=header, header_bytes=length, file_bytes=size)
