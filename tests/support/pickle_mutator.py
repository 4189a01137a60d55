"""A seeded mutator of unpickled objects (DCP's ``Metadata``), for fuzz tests
of torch-format ``.metadata`` (issue 32: "typed error or correct load").

:func:`mutate_object` edits a deep copy of the object graph: any dict entry,
list or tuple element (``torch.Size`` too), object attribute or dict key's
attribute (``MetadataIndex`` keys of ``storage_data``) is replaced by a value
no field can hold, by a neighbouring integer (one off, or 2**32 off, or
negated), deleted, or duplicated. Like :mod:`tests.support.json_mutator` it
never writes a *plausible* alternative the metadata cannot tell from the
truth: another dtype, or an offset of another stored item (an
``offset * 2`` can be one). What torch's pickle records of each chunk is all
a reader has (torch-format checkpoints have no checksums); those edits are
what only the data's own headers could tell.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HOSTILE", "mutate_object"]

#: Values no field of DCP's metadata holds (or that test its bounds); every
#: one pickles with globals the restricted unpickler admits.
HOSTILE: tuple[Any, ...] = (
    None, True, False, -1, 0, 1, 2**31, 2**63, 2**64, 10**30, 0.5, math.nan, "", "x", "../../etc/passwd",
    "/abs/path", "a\nb", "nul\x00", b"raw", [], [None], [-1, -1], (), (0,), {}, {"": None}, frozenset(),
    torch.Size([]), torch.Size([1 << 40]), torch.Size([-1, 4]), torch.strided, torch.channels_last,
)


@dataclass
class _Slot:
    """One place in the graph: its value, and how to replace, remove or duplicate it."""

    label: str
    value: Any
    put: Callable[[Any], None]
    remove: Callable[[], None] | None = None
    duplicate: Callable[[], None] | None = None


def _neighbour(value: int, rng: random.Random) -> int:
    return rng.choice([value + 1, value - 1, value + 2**32, -value])


def _tuple_slots(value: tuple[Any, ...], label: str, put: Callable[[Any], None], out: list[_Slot]) -> None:
    kind: Callable[[Any], tuple[Any, ...]] = type(value) if type(value) is torch.Size else tuple

    def rebuilt(items: list[Any]) -> tuple[Any, ...]:
        try:
            return kind(items)
        except (TypeError, ValueError, OverflowError):  # torch.Size holds ints only
            return tuple(items)

    for i, item in enumerate(value):
        def put_item(new: Any, i: int = i) -> None:
            put(rebuilt([*value[:i], new, *value[i + 1:]]))

        out.append(_Slot(f"{label}[{i}]", item, put_item,
                         remove=lambda i=i: put(rebuilt([*value[:i], *value[i + 1:]])),
                         duplicate=lambda i=i: put(rebuilt([*value[:i + 1], *value[i:]]))))


def _walk(obj: Any, label: str, put: Callable[[Any], None], out: list[_Slot], depth: int = 0) -> None:
    if depth > 12:
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            here = f"{label}[{_show(key)}]"
            out.append(_Slot(here, value, lambda new, k=key: obj.__setitem__(k, new),
                             remove=lambda k=key: obj.__delitem__(k)))
            _walk(value, here, lambda new, k=key: obj.__setitem__(k, new), out, depth + 1)
            if hasattr(key, "__dict__"):
                _key_slots(obj, key, f"{label}.key({_show(key)})", out)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out.append(_Slot(f"{label}[{i}]", value, lambda new, i=i: obj.__setitem__(i, new),
                             remove=lambda i=i: obj.__delitem__(i),
                             duplicate=lambda i=i: obj.insert(i, copy.deepcopy(obj[i]))))
            _walk(value, f"{label}[{i}]", lambda new, i=i: obj.__setitem__(i, new), out, depth + 1)
    elif isinstance(obj, tuple):
        _tuple_slots(obj, label, put, out)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.dtype, torch.layout, torch.memory_format)):
        for name, value in list(vars(obj).items()):
            here = f"{label}.{name}"
            out.append(_Slot(here, value, lambda new, n=name: vars(obj).__setitem__(n, new),
                             remove=lambda n=name: vars(obj).pop(n)))
            _walk(value, here, lambda new, n=name: vars(obj).__setitem__(n, new), out, depth + 1)


def _key_slots(mapping: dict[Any, Any], key: Any, label: str, out: list[_Slot]) -> None:
    """Slots of a dict key's attributes: an edit makes a new key in the key's place."""

    def rekey(name: str, new: Any) -> None:
        changed = copy.copy(key)
        vars(changed)[name] = new
        hash(changed)  # an unhashable key cannot be made in memory (in a pickle it fails to load)
        items = list(mapping.items())
        mapping.clear()
        mapping.update((changed if k is key else k, v) for k, v in items)

    for name, value in list(vars(key).items()):
        out.append(_Slot(f"{label}.{name}", value, lambda new, n=name: rekey(n, new)))
        if isinstance(value, tuple):
            _tuple_slots(value, f"{label}.{name}", lambda new, n=name: rekey(n, new), out)


def mutate_object(root: Any, rng: random.Random, edits: int = 1) -> tuple[Any, list[str]]:
    """A mutated deep copy of ``root`` and a description of each edit.

    Args:
        root: An unpickled object graph (DCP's ``Metadata``); it must pickle.
        rng: The seeded source of choices.
        edits: How many edits to make.
    """
    root = pickle.loads(pickle.dumps(root))  # a deep copy, several times faster than copy.deepcopy
    done: list[str] = []
    while len(done) < edits:
        slots: list[_Slot] = []
        _walk(root, "metadata", lambda new: None, slots)
        slot = rng.choice(slots)
        op = rng.random()
        try:
            if op < 0.15 and slot.remove is not None:
                slot.remove()
                done.append(f"del {slot.label}")
            elif op < 0.25 and slot.duplicate is not None:
                slot.duplicate()
                done.append(f"duplicate {slot.label}")
            else:
                plain_int = type(slot.value) is int
                value = _neighbour(slot.value, rng) if plain_int and op < 0.6 else copy.deepcopy(rng.choice(HOSTILE))
                slot.put(value)
                done.append(f"{slot.label} = {_show(value)}")
        except (TypeError, AttributeError, ValueError, OverflowError):
            continue  # an edit that cannot be made in memory (an unhashable key): choose another
    return root, done


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a half-edited object (a torch.Size of 2**64)
        text = f"<{type(value).__name__}>"
    return text if len(text) < 40 else text[:37] + "..."
