"""Who holds what in a root: every save lock and lease, and breaking one by hand.

``dcp-ext locks ROOT`` lists them (:func:`list_records`) with each holder's
host, pid, age and heartbeat, judged by the one liveness rule
(:mod:`dcp_ext.guard._liveness`); ``dcp-ext locks ROOT --break NAME``
removes one (:func:`break_record`), refusing while its holder is alive.
A lock lives at ``{tag}_partial/.dcp_ext.saving``, a lease at
``.dcp_ext.lease.<id>.json`` in the root. Plain I/O by one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..config import IOConfig
from ..errors import CheckpointInUseError, CheckpointNotFoundError, InvalidPathError
from ..guard import LOCK_FILE, LockState, file_state, is_lease_name
from ..layout import PARTIAL_SUFFIX, partial_dir
from ..storage import Store

__all__ = ["HeldRecord", "list_records", "break_record"]


@dataclass(frozen=True)
class HeldRecord:
    """One lock or lease file in a root.

    Attributes:
        name: Its path relative to the root (``step3_partial/.dcp_ext.saving``
            or ``.dcp_ext.lease.<id>.json``).
        kind: ``"lock"`` or ``"lease"``.
        state: What the one rule says of it.
    """

    name: str
    kind: str
    state: LockState

    def line(self, now: float | None = None) -> str:
        """One line for ``dcp-ext locks``."""
        now = time.time() if now is None else now
        record = self.state.record
        if record is None:
            holder, beat = "damaged record", "-"
        else:
            holder = record.holder() + (f" saving {record.tag!r} on {record.base!r}" if record.base else "")
            beat = f"{now - record.heartbeat:.0f} s ago" if record.heartbeat is not None else "none"
        verdict = "live" if self.state.live else "dead"
        return (f"{self.name}  {self.kind}  {verdict}  {holder}  age {now - record.started:.0f} s  "
                f"heartbeat {beat}  ({self.state.reason})" if record is not None else
                f"{self.name}  {self.kind}  {verdict}  {holder}  ({self.state.reason})")


def list_records(root: Store, partial_store: Callable[[str], Store], tags: Iterable[str],
                 config: IOConfig) -> list[HeldRecord]:
    """Every lock (one per ``{tag}_partial``) and lease under the root, judged now."""
    found = []
    for name in sorted(root.list_names()):
        if is_lease_name(name):
            state = file_state(root, name, config=config)
            if state is not None:
                found.append(HeldRecord(name, "lease", state))
    for tag in sorted(tags):
        state = file_state(partial_store(tag), LOCK_FILE, config=config)
        if state is not None:
            found.append(HeldRecord(f"{partial_dir(tag)}/{LOCK_FILE}", "lock", state))
    return found


def break_record(root: Store, partial_store: Callable[[str], Store], name: str, config: IOConfig,
                 *, force: bool = False) -> HeldRecord:
    """Remove the lock or lease ``name``; refused while its holder is alive, unless ``force``.

    Returns:
        The record as it was judged before it was removed.

    Raises:
        InvalidPathError: ``name`` names neither a lock nor a lease.
        CheckpointNotFoundError: There is no such file.
        CheckpointInUseError: Its holder is alive.
    """
    directory, _, file = name.strip("/").rpartition("/")
    if not directory and is_lease_name(file):
        store, kind = root, "lease"
    elif directory.endswith(PARTIAL_SUFFIX) and "/" not in directory and file == LOCK_FILE:
        store, kind = partial_store(directory[: -len(PARTIAL_SUFFIX)]), "lock"
    else:
        raise InvalidPathError(f"{name!r} is not a lock ({{tag}}_partial/{LOCK_FILE}) or a lease "
                               f"(.dcp_ext.lease.<id>.json) of this root; `dcp-ext locks ROOT` lists them")
    state = file_state(store, file, config=config)
    if state is None:
        raise CheckpointNotFoundError(f"no {kind} {store.describe(file)}", store.describe(file))
    if state.live and not force:
        raise CheckpointInUseError(
            f"not breaking {state.where}: {state.reason}; {state.expiry()}. Its holder may still be saving; "
            f"if you know it is gone, pass --force", state.where)
    store.delete(file)
    return HeldRecord(name, kind, state)
