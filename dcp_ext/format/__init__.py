"""Byte formats below the metadata: codecs, torch's bytes and envelopes, tagged JSON, safetensors, user content."""

from __future__ import annotations

from ._auto import AutoCodec, WriteRates, encode_rates, resolve_codec, write_rates
from ._codecs import Codec, ZstdCodec, check_descriptors, decode_frame
from ._safetensors import (
    MAX_HEADER,
    SafetensorsHeader,
    build_header,
    header_prefix,
    parse_header,
)
from ._stored_json import PARSE_ERRORS, parse_stored_json
from ._tagged_json import UnsupportedValueError, decode_tree, encode_tree
from ._torch_bytes import (
    DTYPES,
    Envelope,
    HoleRecorder,
    dtype_from_name,
    dtype_name,
    tensor_bytes,
    torch_save_envelope,
)
from ._torch_items import ARCHIVE_SLACK, decode_item, load_tensor, stream_extensions
from ._user_content import (
    UnsafeUserContentError,
    decode_user_content,
    encode_user_content,
)

__all__ = [
    "PARSE_ERRORS",
    "parse_stored_json",
    "ARCHIVE_SLACK",
    "AutoCodec",
    "Codec",
    "DTYPES",
    "Envelope",
    "MAX_HEADER",
    "SafetensorsHeader",
    "UnsafeUserContentError",
    "UnsupportedValueError",
    "WriteRates",
    "ZstdCodec",
    "HoleRecorder",
    "build_header",
    "check_descriptors",
    "decode_frame",
    "decode_item",
    "decode_tree",
    "decode_user_content",
    "dtype_from_name",
    "dtype_name",
    "encode_rates",
    "encode_tree",
    "encode_user_content",
    "header_prefix",
    "load_tensor",
    "parse_header",
    "resolve_codec",
    "stream_extensions",
    "tensor_bytes",
    "torch_save_envelope",
    "write_rates",
]
