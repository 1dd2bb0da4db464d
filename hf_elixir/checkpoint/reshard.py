"""Resharding: read any element range of a saved parameter, whatever world size and plan
wrote it.

A checkpoint stores every trainable parameter as the slices its ranks owned: slice
``[begin, end)`` of the flattened parameter in rank r's files, under the parameter's name
(and ``<name>/<state>`` for its optimizer state). To fill a slice it owns now, a loading rank
copies the overlapping parts of the saved slices, so any world size, chunk size or placement
can be rebuilt from any other, bit for bit, without a gather. Export reads whole parameters
the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from hf_elixir.checkpoint.index import INDEX_NAME, UNTRACKED_NAME
from hf_elixir.checkpoint.io import SafetensorsReader
from hf_elixir.checkpoint.names import check_index_names, member


class SavedSlices:
    """A saved checkpoint's slices: reads any element range of a saved parameter (or of its
    optimizer state) by copying the overlapping parts of the saved slices; files are opened
    on first use. Whatever index it is given, its file names are checked first to be files
    of the checkpoint's folder (``names.py``), and again where a name is joined to it."""

    def __init__(self, path: Path, index: dict) -> None:
        check_index_names(path, index, str(path / INDEX_NAME))
        self.path = path
        self.index = index
        self.params = {p["name"]: p for p in index["params"]}
        self.untracked = {u["name"]: u for u in index.get("untracked", [])}
        self._readers: dict[str, SafetensorsReader] = {}

    def reader(self, fname: str) -> SafetensorsReader:
        if fname not in self._readers:
            self._readers[fname] = SafetensorsReader(member(self.path, fname, str(self.path / INDEX_NAME)))
        return self._readers[fname]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def files_for(self, name: str, begin: int, end: int, kind: str) -> list[str]:
        if name not in self.params:
            return [UNTRACKED_NAME] if kind == "model" and name in self.untracked else []
        out = []
        for r, sb, se in self.params[name]["slices"]:
            if sb < end and begin < se:
                out.append(self.index["rank_files"][r][kind])
        return out

    def read(self, name: str, begin: int, end: int, out: torch.Tensor, state: Optional[str] = None) -> None:
        """Fill ``out`` (fp32, end-begin elements) with elements [begin, end) of ``name``
        (or of its optimizer state ``state``)."""
        if name not in self.params:  # saved frozen: whole in the untracked file
            tmp = self.reader(UNTRACKED_NAME).read(name, begin, end)
            out.copy_(tmp)
            return
        kind = "model" if state is None else "optimizer"
        key = name if state is None else f"{name}/{state}"
        for r, sb, se in self.params[name]["slices"]:
            lo, hi = max(begin, sb), min(end, se)
            if lo >= hi:
                continue
            reader = self.reader(self.index["rank_files"][r][kind])
            dst = out[lo - begin : hi - begin]
            if dst.device.type == "cpu" and dst.dtype == torch.float32 and dst.is_contiguous():
                reader.read(key, lo - sb, hi - sb, out=dst)
            else:
                dst.copy_(reader.read(key, lo - sb, hi - sb))

    def step(self, name: str) -> float:
        r = self.params[name]["slices"][0][0]
        return float(self.reader(self.index["rank_files"][r]["optimizer"]).read(f"{name}/step")[0])
