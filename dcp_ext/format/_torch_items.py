"""Items of checkpoints written by torch's own ``FileSystemWriter``/``FsspecWriter``.

Torch stores each tensor as a complete ``torch.save`` archive and each other
value as the bytes DCP's planner pickled, back to back in ``.distcp`` files.
With ``FileSystemWriter(_extensions=[...])`` every item's bytes went through
stream extensions (``ZStandard``: one zstd stream per item), and the item's
``_StorageInfo.transform_descriptors`` names them (``"stream.zstd/1"``).
Decoding rebuilds the chain from those descriptors with an
``ExtensionRegistry`` (torch's default one knows ``ZStandard``; callers
register their own extensions).

Order: torch's writer records the descriptors in the order their transforms
reached the data (``_StorageWriterTransforms`` wraps the file stream with
each extension in turn and records them reversed), so the last one listed
was applied last and is undone first. Torch's ``FileSystemReader`` (2.13)
wraps the stream in the listed order instead, which undoes a chain of two
extensions in the wrong order: only single-extension items round-trip
through it. Decoding here undoes the listed extensions last to first, which
is the same for one extension and right for chains torch's writer wrote.

A stream item is read whole (its compressed bytes cannot be read from the
middle) and decoded into at most ``limit`` bytes, so a hostile stream cannot
inflate without bound.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Any

import torch

from .._runtime import ExtensionRegistry, StreamTransformExtension
from ..errors import CheckpointCorruptError, UnsupportedCodecError

__all__ = ["stream_extensions", "decode_item", "load_tensor", "ARCHIVE_SLACK"]

#: Bytes a ``torch.save`` archive adds around a tensor's data (zip records,
#: ``data.pkl``, alignment): a few KiB in practice; decoded items may exceed
#: the tensor's raw size by at most this.
ARCHIVE_SLACK = 1 << 20

_READ_STEP = 1 << 22


def stream_extensions(registry: Any, descriptors: Sequence[str], where: str, fqn: str) -> list[Any]:
    """The stream extensions that decode an item, in the order they are undone
    (the reverse of ``descriptors``).

    Args:
        registry: A torch ``ExtensionRegistry``; ``None``: torch's default one
            (``ZStandard`` only).
        descriptors: The item's ``transform_descriptors``.
        where: The data file, for messages.
        fqn: The item's key, for messages.

    Raises:
        UnsupportedCodecError: An extension the registry does not know, a
            version it refuses, or a missing package (``zstandard``); the
            message names the extension, the file and the key.
    """
    if ExtensionRegistry is None:
        raise UnsupportedCodecError(
            f"{where}: {fqn!r} was written with torch stream extensions {list(descriptors)}, "
            f"and this torch ({torch.__version__}) has none; load it with torch 2.7 or later",
            where,
        )
    chosen = ExtensionRegistry() if registry is None else registry
    extensions = []
    for descriptor in descriptors:
        try:
            (extension,) = chosen.from_descriptor_list([descriptor])
        except Exception as err:
            known = sorted(getattr(chosen, "extensions", {}))
            raise UnsupportedCodecError(
                f"{where}: {fqn!r} was written with torch stream extension {descriptor!r}, which "
                f"{'the extension registry passed' if registry is not None else 'torch default ExtensionRegistry'} "
                f"cannot decode ({err}; it knows {known}). Register the extension's class in a torch "
                f"ExtensionRegistry and pass it as CheckpointReader(extension_registry=...) or "
                f"dcp_ext.load(..., extension_registry=...)",
                where,
            ) from err
        # torch's reader skips extensions that do not transform the stream
        if isinstance(extension, StreamTransformExtension):
            extensions.append(extension)
    return extensions[::-1]


def decode_item(
    data: bytes | bytearray,
    extensions: Sequence[Any],
    limit: int,
    where: str,
    fqn: str,
    descriptors: Sequence[str],
) -> bytes:
    """The item's bytes once its stream extensions are undone, first to last
    of ``extensions`` (as :func:`stream_extensions` orders them).

    Raises:
        CheckpointCorruptError: The stream does not decode, or decodes to
            more than ``limit`` bytes.
    """
    stream: IO[bytes] = io.BytesIO(data)
    out = bytearray()
    try:
        for extension in extensions:
            stream = extension.transform_from(stream)
        while True:
            piece = stream.read(min(_READ_STEP, limit + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > limit:
                raise CheckpointCorruptError(
                    f"{where}: {fqn!r} (torch stream extensions {list(descriptors)}) decodes to more "
                    f"than {limit} bytes, more than its metadata allows; the file is damaged or hostile",
                    where,
                )
    except CheckpointCorruptError:
        raise
    except Exception as err:
        raise CheckpointCorruptError(
            f"{where}: {fqn!r} cannot be decoded with torch stream extensions {list(descriptors)} "
            f"({type(err).__name__}: {err}); the file is damaged",
            where,
        ) from err
    return bytes(out)


def load_tensor(data: bytes | bytearray, where: str, span: tuple[int, int], fqn: str) -> torch.Tensor:
    """The tensor of a ``torch.save`` archive, loaded with ``weights_only=True``.

    Raises:
        CheckpointCorruptError: Not a valid archive of a tensor.
    """
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointCorruptError(
            f"{where}: bytes [{span[0]}, {span[1]}) holding {fqn!r} are not a valid "
            f"torch.save archive ({err})",
            where,
        ) from err
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointCorruptError(
            f"{where}: bytes [{span[0]}, {span[1]}) holding {fqn!r} hold a {type(tensor).__name__}, not a tensor",
            where,
        )
    return tensor
