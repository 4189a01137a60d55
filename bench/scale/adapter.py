"""The scale simulator's only calls into dcp_ext's metadata format (what a save writes, what a load reads).

Change this module, and nothing else, when the format changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_ext.metadata import StoredItem

__all__ = [
    "EncodedMetadata",
    "finish_data_file",
    "pack_rank_results",
    "collect_dcp_ext",
    "encode_dcp_ext",
    "decode_dcp_ext",
    "attach_dcp_ext_indexes",
    "metadata_version",
]


# -- the adapter: the only calls into dcp_ext's metadata format ---------------------------
#
# Version 3 (dcp_ext's default since commit dfeb22b): each data file ends with a
# binary frame index, and the JSON document holds a compact chunk table and
# where each index lies. Version 2: one JSON document with every frame's
# checksum. These functions write what dcp_ext's writer writes by default
# (``IOConfig().metadata_version``), split as the save splits the work: each
# rank finishes its data files (finish_data_file), the coordinator encodes the
# document (encode_dcp_ext), every loading rank decodes it (decode_dcp_ext) and
# reads the indexes of the files it reads (attach_dcp_ext_indexes). They also
# run against a dcp_ext from before version 3 (its modules are imported only
# when version 3 is written).


@dataclass(frozen=True)
class EncodedMetadata:
    """A checkpoint's encoded dcp_ext metadata.

    Attributes:
        global_bytes: The document every loading rank reads (``dcp_ext.metadata.json``).
        file_indexes: Per data file, the index only the ranks reading that
            file need (none for metadata version 2).
    """

    global_bytes: bytes
    file_indexes: dict[str, bytes] = field(default_factory=dict)


def metadata_version() -> int:
    """The metadata version dcp_ext's writer writes by default."""
    from dcp_ext.config import IOConfig
    from dcp_ext.metadata import document

    return int(getattr(IOConfig(), "metadata_version", document.FORMAT_VERSION))


def finish_data_file(name: str, items: list[StoredItem]) -> tuple[list[StoredItem], bytes]:
    """(each rank, ``CheckpointWriter`` at the end of each data file) The items
    as the writer reports them to the coordinator, and what it appends to the
    file after them.

    Args:
        name: The data file.
        items: Its items in file order, each with every frame's checksum (as
            ``FrameEncoder`` makes them).

    Returns:
        Version 3: the items without frame tables, pointing at the file's
        frame index, and that index (``writer._append_frame_index``).
        Version 2: the items as given, and nothing.
    """
    if metadata_version() < 3:
        return items, b""
    import xxhash

    from dcp_ext.metadata.document import FrameIndexRef
    from dcp_ext.metadata.frame_index import encode_frame_index

    index = encode_frame_index(items)
    end = items[-1].offset + items[-1].length if items else 0
    ref = FrameIndexRef(end, len(index), xxhash.xxh3_64_intdigest(index))
    return [replace(item, frame_lengths=(), checksums=(), indexed=True, frame_index=ref) for item in items], index


def pack_rank_results(positions: list[int], stored: list[StoredItem]) -> list[Any]:
    """(each rank, ``CheckpointWriter.write_data``) The rank's write results
    packed into one, as it reports them with metadata version 3."""
    if metadata_version() < 3:
        raise ValueError("packed write results need metadata version 3")
    from dcp_ext.planning import pack_results

    return pack_results(positions, stored)


def collect_dcp_ext(metadata: Metadata, results: list[list[Any]]) -> Any:
    """(coordinator, ``CheckpointWriter.finish``) Where every chunk went."""
    from dcp_ext.planning import collect_stored

    return collect_stored(metadata, results)


def encode_dcp_ext(metadata: Metadata, items: Any, world_size: int) -> bytes:
    """(coordinator, ``CheckpointWriter.finish``) The metadata document for the
    writers' results (``items``, each as :func:`finish_data_file` returned it)."""
    from dcp_ext.metadata import encode_metadata

    if metadata_version() < 3:
        return encode_metadata(metadata, items, world_size=world_size)
    return encode_metadata(metadata, items, world_size=world_size, version=metadata_version())


def decode_dcp_ext(encoded: EncodedMetadata) -> Any:
    """(every loading rank, ``CheckpointReader.read_metadata``) The global
    document decoded: a ``DecodedMetadata`` whose ``.metadata`` is DCP's."""
    from dcp_ext.metadata import METADATA_FILE, decode_metadata

    return decode_metadata(encoded.global_bytes, METADATA_FILE)


def attach_dcp_ext_indexes(decoded: Any, encoded: EncodedMetadata, names: set[str]) -> int:
    """(a loading rank, before reading) The frame indexes of the files ``names``
    read and attached to their items; returns their bytes (``0`` for version 2)."""
    refs = getattr(decoded, "frame_indexes", None)
    if not refs:
        return 0
    from dcp_ext.metadata.frame_index import attach_frame_indexes

    attach_frame_indexes(decoded.metadata.storage_data, names, refs, lambda name, ref: encoded.file_indexes[name],
                         str, 1)
    return sum(len(encoded.file_indexes[name]) for name in names)
