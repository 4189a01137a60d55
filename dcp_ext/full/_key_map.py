"""Renaming state-dict keys between a checkpoint and a model: ``key_map`` and ``translate_function``.

Three ways to say how keys are renamed, all resolved here into one
``{old key: new key}`` table before anything is read or written:

- ``key_map`` as a callable: ``key -> new key``, or ``None`` to skip the key;
- ``key_map`` as a dict ``{old key: new key}``: keys not in it keep their
  name, a value of ``None`` skips the key;
- ``translate_function`` (the SageMaker model-parallel library's form): a
  callable that receives the list of *all* keys at once and returns a
  mapping ``{old key: new key}``; keys absent from the mapping keep their
  name, a value of ``None`` skips the key, and names in the mapping that are
  not keys are ignored (so one function can serve several model variants).

Two keys given one name is an error naming both: a silent last-one-wins would
load the wrong tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Union

from ..errors import CheckpointKeyError

__all__ = ["KeyMap", "TranslateFunction", "rename_keys"]

#: ``key -> new key or None (skip)``, or ``{old key: new key or None}`` (others keep their name).
KeyMap = Union[Callable[[str], Union[str, None]], Mapping[str, Union[str, None]]]
#: ``[all keys] -> {old key: new key or None}`` (keys absent keep their name).
TranslateFunction = Callable[[list[str]], Mapping[str, Union[str, None]]]


def rename_keys(
    keys: Sequence[str],
    *,
    key_map: KeyMap | None = None,
    translate_function: TranslateFunction | None = None,
    where: str,
    exclude: Collection[str] = (),
) -> dict[str, str]:
    """(any rank) The new name of every key that is kept, in the order of ``keys``.

    Args:
        keys: All keys, e.g. a checkpoint's tensor names.
        key_map: A callable or a dict (see the module docstring).
        translate_function: A callable over the whole list of keys.
        where: The checkpoint (or model) the keys belong to, for messages.
        exclude: Keys that take part in ``translate_function``'s input but
            are consumed otherwise (FP8 scales): left out of the result.

    Returns:
        ``{old key: new key}``; skipped and excluded keys are absent.

    Raises:
        ValueError: Both ``key_map`` and ``translate_function`` were given.
        TypeError: A mapping or a new name of the wrong type.
        CheckpointKeyError: Two keys get the same new name (both are named).
    """
    if key_map is not None and translate_function is not None:
        raise ValueError("pass key_map or translate_function, not both")
    names: dict[str, str | None]
    if translate_function is not None:
        table = translate_function(list(keys))
        if not isinstance(table, Mapping):
            raise TypeError(
                f"translate_function must return a mapping {{old key: new key}}, got {type(table).__name__}"
            )
        names = {k: table.get(k, k) for k in keys}
    elif isinstance(key_map, Mapping):
        names = {k: key_map.get(k, k) for k in keys}
    elif key_map is not None:
        if not callable(key_map):
            raise TypeError(f"key_map must be a callable or a dict, got {type(key_map).__name__}")
        names = {k: key_map(k) for k in keys}
    else:
        names = {k: k for k in keys}
    renamed: dict[str, str] = {}
    owner: dict[str, str] = {}
    for old, new in names.items():
        if old in exclude or new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(f"{where}: key {old!r} is renamed to {new!r}, which is not a string (or None to skip)")
        if new in owner:
            raise CheckpointKeyError(
                f"{where}: keys {owner[new]!r} and {old!r} are both renamed to {new!r}; "
                f"fix the key_map / translate_function so each name is used once (None skips a key)"
            )
        owner[new] = old
        renamed[old] = new
    return renamed
