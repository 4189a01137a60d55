"""Renaming state-dict keys between a checkpoint and a model: ``key_map``.

Three ways to say how keys are renamed, all resolved here into one
``{old key: new key}`` table before anything is read or written (so each
rank still reads only its slices):

- a callable: ``key -> new key``, or ``None`` to skip the key;
- a dict ``{old key: new key}``: keys not in it keep their name, a value of
  ``None`` skips the key;
- :class:`KeyList` wrapping a callable that receives the list of *all* keys
  at once and returns a mapping ``{old key: new key}``; keys absent from the
  mapping keep their name, a value of ``None`` skips the key, and names in
  the mapping that are not keys are ignored (so one function can serve
  several model variants). This was ``translate_function``'s form before
  issue 34; ``translate_function`` is now the SageMaker library's
  state-dict translation (:data:`TranslateFunction`).

Two keys given one name is an error naming both: a silent last-one-wins would
load the wrong tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import CheckpointKeyError

__all__ = ["KeyList", "KeyMap", "TranslateFunction", "rename_keys", "translate_state"]


@dataclass(frozen=True)
class KeyList:
    """A ``key_map`` given the list of all keys at once (SageMaker's key-list form).

    ``load_pretrained(model, path, key_map=KeyList(fn))`` calls ``fn`` once
    with every key of the checkpoint; unlike ``translate_function`` it only
    renames, so each rank still reads only its slices.

    Args:
        function: ``[all keys] -> {old key: new key or None}`` (keys absent keep their name).

    Attributes:
        function: ``[all keys] -> {old key: new key or None}`` (keys absent keep their name).
    """

    function: Callable[[list[str]], Mapping[str, Union[str, None]]]

    def __call__(self, keys: list[str]) -> Mapping[str, Union[str, None]]:
        """``function(keys)``: the new name of each key (``None``: skip it; absent: keep its
        name)."""
        return self.function(keys)


#: ``key -> new key or None (skip)``, ``{old key: new key or None}`` (others
#: keep their name), or a :class:`KeyList`.
KeyMap = Union[Callable[[str], Union[str, None]], Mapping[str, Union[str, None]], KeyList]
#: The SageMaker library's state-dict translation: ``{key: tensor} -> {key: tensor}``
#: (keys renamed, values possibly transformed: fused, split, transposed).
TranslateFunction = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def rename_keys(
    keys: Sequence[str],
    *,
    key_map: KeyMap | None = None,
    where: str,
    exclude: Collection[str] = (),
) -> dict[str, str]:
    """(any rank) The new name of every key that is kept, in the order of ``keys``.

    Args:
        keys: All keys, e.g. a checkpoint's tensor names.
        key_map: A callable, a dict or a :class:`KeyList` (see the module docstring).
        where: The checkpoint (or model) the keys belong to, for messages.
        exclude: Keys that take part in a :class:`KeyList`'s input but are
            consumed otherwise (FP8 scales): left out of the result.

    Returns:
        ``{old key: new key}``; skipped and excluded keys are absent.

    Raises:
        TypeError: A mapping or a new name of the wrong type.
        CheckpointKeyError: Two keys get the same new name (both are named).
    """
    names: dict[str, str | None]
    if isinstance(key_map, KeyList):
        table = key_map(list(keys))
        if not isinstance(table, Mapping):
            raise TypeError(f"a KeyList function must return a mapping {{old key: new key}}, got {type(table).__name__}")
        names = {k: table.get(k, k) for k in keys}
    elif isinstance(key_map, Mapping):
        names = {k: key_map.get(k, k) for k in keys}
    elif key_map is not None:
        if not callable(key_map):
            raise TypeError(f"key_map must be a callable, a dict or a KeyList, got {type(key_map).__name__}")
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
                f"fix the key_map so each name is used once (None skips a key)"
            )
        owner[new] = old
        renamed[old] = new
    return renamed


def translate_state(state: dict[str, Any], translate_function: TranslateFunction, where: str) -> dict[str, Any]:
    """(any rank) ``translate_function(state)``, checked: a mapping of string
    keys to tensors (a full checkpoint holds tensors only).

    Raises:
        TypeError: It returned something else; the message names ``where``
            and the first key or value at fault.
    """
    out = translate_function(state)
    if not isinstance(out, Mapping):
        raise TypeError(f"{where}: translate_function must return a state dict, got {type(out).__name__}")
    for key, value in out.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: translate_function returned {key!r}: {type(value).__name__}; "
                            f"a state dict of string keys and tensors is needed")
    return dict(out)
