"""A seeded mutator of JSON documents and binary records, for fuzz tests
(issue 32: "typed error or correct load, never another exception").

Mutations put values where a field's type or range cannot hold them (numbers
JSON allows but no writer produces: NaN, Infinity, 10**400; strings that are
paths out of a directory or hold NUL and line breaks; lists and objects where
scalars belong; nesting deep enough to exhaust Python's recursion limit),
delete and add members, and flip bytes. They never write a *plausible*
alternative value (another valid dtype, a neighbouring offset): a document
re-signed after such an edit is trusted by design, so a load must then be
correct; after the mutations here it must be a typed error or a correct load.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

__all__ = ["HOSTILE", "mutate_tree", "dump", "resign", "flip_bytes"]

_DEEP = "@@DEEP@@"
_NEAR_LIMIT = "@@NEARLIMIT@@"
#: Values no field of any dcp_ext file can hold (or that test its bounds).
HOSTILE: tuple[Any, ...] = (
    None, True, False, -1, 0.5, 4.9, 2**31, 2**63, 2**64, 10**400, float("inf"), float("-inf"), float("nan"),
    "", "x", "../../etc/passwd", "/abs/path", "a\nb", "nul\x00byte", "é" * 300, [], [None], [-1, -1], [[[]]], {},
    {"": None}, {"__tuple__": 1}, _DEEP, _NEAR_LIMIT,
)

JsonPath = tuple[Any, ...]


def _paths(tree: Any, path: JsonPath = ()) -> Iterator[JsonPath]:
    yield path
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, (*path, key))
    elif isinstance(tree, list):
        for k, value in enumerate(tree):
            yield from _paths(value, (*path, k))


def _parent(tree: Any, path: JsonPath) -> Any:
    for step in path[:-1]:
        tree = tree[step]
    return tree


def mutate_tree(
    tree: Any, rng: random.Random, edits: int = 1, fixed_length: Callable[[JsonPath], bool] | None = None
) -> tuple[Any, list[str]]:
    """A mutated deep copy of ``tree`` and a description of each edit.

    Args:
        tree: A parsed JSON document.
        rng: The seeded source of choices.
        edits: How many edits to make.
        fixed_length: Paths (of an element) whose list must not lose or gain
            elements: where one fewer element is another valid value (a codec
            chain without one of its transforms), which a re-signed document
            is trusted to state.
    """
    tree = copy.deepcopy(tree)
    done: list[str] = []
    for _ in range(edits):
        paths = list(_paths(tree))
        path = rng.choice(paths[1:] or paths)
        op = rng.random()
        if not path:
            tree = _hostile(rng)
            done.append(f"root = {_show(tree)}")
            continue
        parent = _parent(tree, path)
        if op >= 0.7 and isinstance(parent, list) and fixed_length is not None and fixed_length(path):
            op = 0.0
        if op < 0.7:
            value = _hostile(rng)
            parent[path[-1]] = value
            done.append(f"{list(path)} = {_show(value)}")
        elif op < 0.85:
            del parent[path[-1]]
            done.append(f"del {list(path)}")
        else:
            value = _hostile(rng)
            if isinstance(parent, list):
                parent.insert(path[-1], value)
                done.append(f"insert {_show(value)} at {list(path)}")
            else:
                key = rng.choice(["", "x", "__metadata__", "weight_map", "\n"])
                parent[key] = value
                done.append(f"{list(path[:-1]) + [key]} = {_show(value)}")
    return tree, done


def _hostile(rng: random.Random) -> Any:
    """One of :data:`HOSTILE`, copied (lists and dicts are edited later)."""
    return copy.deepcopy(rng.choice(HOSTILE))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def dump(tree: Any) -> bytes:
    """``tree`` as JSON bytes, NaN and Infinity written as Python writes them
    and the deep-nesting markers expanded."""
    text = json.dumps(tree, separators=(",", ":")).encode()
    return text.replace(json.dumps(_DEEP).encode(), b"[" * 50_000 + b"]" * 50_000).replace(
        json.dumps(_NEAR_LIMIT).encode(), b"[" * 900 + b"]" * 900)


_INTEGRITY = re.compile(rb'"integrity":"xxh3-64:([0-9a-f]{16})"\}$')


def resign(data: bytes) -> bytes:
    """Recompute a metadata document's ``integrity`` digest over its (edited)
    bytes, as a deliberate edit would; unchanged if it has no such field."""
    found = _INTEGRITY.search(data)
    if found is None:
        return data
    zeroed = data[: found.start(1)] + b"0" * 16 + data[found.end(1):]
    return zeroed[: found.start(1)] + f"{xxhash.xxh3_64_intdigest(zeroed):016x}".encode() + zeroed[found.end(1):]


def flip_bytes(data: bytes, rng: random.Random, count: int = 1) -> tuple[bytes, list[str]]:
    """``data`` with ``count`` random bytes replaced by random values."""
    out = bytearray(data)
    done = []
    for _ in range(count):
        if not out:
            break
        at = rng.randrange(len(out))
        out[at] = rng.randrange(256)
        done.append(f"byte {at} = {out[at]:#x}")
    return bytes(out), done
