"""Checkpoint metadata on storage: dcp_ext's JSON document and torch's pickle.

* :mod:`.document`: the ``dcp_ext.metadata.json`` format, the items it
  records (:class:`StoredItem`), :func:`seal` and its own checksum;
* :mod:`.encode`: writing it (:func:`encode_metadata`), with the chunk
  columns of :mod:`.stored_columns`;
* :mod:`.decode`: reading and validating it (:func:`decode_metadata`), and
  the commit time from its first bytes (:func:`read_created`);
* :mod:`.torch_pickle`: torch's ``.metadata``, written for interop and read
  with a restricted unpickler;
* :mod:`.torch_checks`: what that pickle holds, checked against itself
  (:func:`check_torch_metadata`; :func:`tiling_problem` for any chunk list).
"""

from __future__ import annotations

from .decode import (
    DecodedMetadata,
    IncrementalSection,
    decode_metadata,
    read_created,
    read_incremental_section,
    read_leading_field,
)
from .document import (
    FORMAT_VERSION,
    MAX_FRAME_SIZE,
    METADATA_FILE,
    TORCH_METADATA_FILE,
    StoredItem,
    check_integrity,
    chunk_shapes,
    seal,
    validate_file_name,
)
from .encode import encode_metadata
from .torch_checks import check_tiling, check_torch_metadata, tiling_problem
from .torch_pickle import load_torch_metadata, to_torch_metadata, torch_reader_marker

__all__ = [
    "METADATA_FILE",
    "TORCH_METADATA_FILE",
    "FORMAT_VERSION",
    "MAX_FRAME_SIZE",
    "StoredItem",
    "DecodedMetadata",
    "IncrementalSection",
    "encode_metadata",
    "decode_metadata",
    "seal",
    "check_integrity",
    "chunk_shapes",
    "validate_file_name",
    "to_torch_metadata",
    "torch_reader_marker",
    "load_torch_metadata",
    "check_torch_metadata",
    "check_tiling",
    "tiling_problem",
    "read_created",
    "read_leading_field",
    "read_incremental_section",
]
