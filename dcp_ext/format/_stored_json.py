"""Parsing JSON read from storage: one place that turns every way it can fail
into :class:`~dcp_ext.errors.CheckpointCorruptError` naming the file.

``json.loads`` on bytes from a damaged or hostile file raises more than
``ValueError``: ``RecursionError`` for deeply nested brackets (100,000 ``[``
fit in a 100 KB file), ``UnicodeDecodeError`` for bytes that are not UTF-8
(issue 32, finding 7).

Python's parser also reads ``NaN``, ``Infinity`` and integers of hundreds of
digits, which no dcp_ext writer produces (non-finite floats are tagged, see
:mod:`dcp_ext.format._tagged_json`). They are let through as the values Python reads
so that the caller's check of each field refuses them by name ("world_size
must be a non-negative 64-bit integer, got inf"): every caller checks the
type and range of what it uses.

Used for the metadata document, safetensors headers, Hugging Face indexes
and torch's sharding information in them.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CheckpointCorruptError

__all__ = ["parse_stored_json", "PARSE_ERRORS"]

#: What parsing a hostile JSON document can raise besides our own errors.
PARSE_ERRORS = (ValueError, UnicodeDecodeError, RecursionError)


def parse_stored_json(data: bytes | str, where: str, what: str = "") -> Any:
    """The value of a JSON document read from storage.

    Args:
        data: The document's bytes (UTF-8) or text.
        where: The file it was read from, for the message.
        what: What the document is (``"safetensors header"``...), for the message.

    Raises:
        CheckpointCorruptError: Not valid JSON, not UTF-8, or nested too
            deeply to parse; the message names ``where``.
    """
    try:
        return json.loads(data)
    except PARSE_ERRORS as err:
        kind = "nested too deeply" if isinstance(err, RecursionError) else str(err)[:200]
        subject = f"{where}: its {what}" if what else where
        raise CheckpointCorruptError(f"{subject} is not valid JSON ({kind}); the file is damaged", where) from err
