"""The KV cache backend contract, shaped exactly like FlexKV's ``KVManager``.

Every backend (the embedded one, the ``flexkv`` adapter) implements
:class:`KVBackend`. The connector and the PP fan-out depend on this module only.

The contract, in FlexKV's terms:

* **Two-phase tasks.** ``get_match`` / ``put_match`` decide *what* to move and
  return ``(task_id, mask)``; ``launch`` later binds engine KV slots to the task
  and starts the copy ("late slot binding"). A matched task that is never
  launched or cancelled keeps its index entries locked until it expires.
* **Masks.** A mask is a ``numpy`` bool array of ``len(token_ids)``. It is True
  over exactly one contiguous, block-aligned span (or nowhere). For ``get`` the
  span is the tokens that can be loaded from the cache, always starting at the
  first unmasked-in token of the request; for ``put`` it is the tokens not yet
  cached (the cached prefix is skipped). A trailing partial block is never in a
  mask.
* **Slot mappings.** The slot mapping handed to ``launch`` holds one engine KV
  slot index per True entry of the task's mask, in token order.
* **Token ids** are int64 numpy arrays on the CPU.
* **Engine buffers.** Before anything moves, every engine rank of the stage
  registers its KV buffers with :meth:`KVBackend.register_kv_buffers` (layout
  and validation in :mod:`node_agent.backend.planes`); ``is_ready`` turns true
  once the backend started and every expected rank registered.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from node_agent.vocab.tokens import int64_array

if TYPE_CHECKING:
    import torch

TokenArray = npt.NDArray[np.int64]
MatchOp = Literal["get", "put"]
"""Which match a backend's ``_match`` makes: ``get_match`` or ``put_match``."""
BoolMask = npt.NDArray[np.bool_]
SlotArray = npt.NDArray[np.int64]


class KVResponseStatus(enum.Enum):
    """Terminal (or not-yet-terminal) state of a task, as FlexKV reports it."""

    SUCCESS = "success"
    """The task finished; every block of its mask was moved."""
    NOTFOUND = "notfound"
    """The task id is unknown (never issued, already reaped, or reset)."""
    UNREADY = "unready"
    """The task exists but has not finished (``try_wait`` / ``wait`` timed out per task)."""
    TIMEOUT = "timeout"
    """``wait`` ran out of time before the task finished."""
    CANCELLED = "cancelled"
    """The task was cancelled or its un-launched match expired."""
    FAILED = "failed"
    """The transfer failed; for a put nothing became visible, for a get the slots
    hold undefined data and must not be used."""

    @property
    def terminal(self) -> bool:
        """True when the task will not change state any more."""
        return self not in (KVResponseStatus.UNREADY, KVResponseStatus.TIMEOUT)


@dataclass(frozen=True)
class KVResponse:
    """Result of one task, as returned by ``wait`` / ``try_wait``.

    ``return_mask`` is the mask of tokens actually moved (equal to the match
    mask on success, all False otherwise); ``None`` when the task is unknown.
    """

    status: KVResponseStatus
    task_id: int
    return_mask: BoolMask | None = None
    error: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TierStats:
    """Capacity and use of one cache tier."""

    capacity_bytes: int
    used_bytes: int
    capacity_blocks: int
    used_blocks: int
    evictions: int = 0
    """Blocks that left this tier (spilled to a lower tier or dropped)."""
    hit_blocks: int = 0
    """Blocks matched by ``get_match`` while resident in this tier."""
    recovered_blocks: int = 0
    """SSD blocks found on disk, verified and served again after a restart."""


@dataclass(frozen=True)
class BackendStats:
    """A snapshot of a backend for ``/status``, the heartbeat Lease and metrics.

    ``tiers`` is keyed by tier name (``cpu``, ``ssd``); ``tasks`` counts live
    tasks by state (``matched``, ``launched``, ``finished``, ``unpublished``).
    ``lookup_tokens`` counts the tokens ``get_match`` was asked for since the
    backend started (the hits are the tiers' ``hit_blocks``); None when the
    backend does not count them.
    """

    tiers: dict[str, TierStats] = field(default_factory=dict)
    tasks: dict[str, int] = field(default_factory=dict)
    registered_ranks: tuple[int, ...] = ()
    expected_ranks: int = 0
    lookup_tokens: int | None = None


class KVBackendError(RuntimeError):
    """A backend operation could not be carried out (the message says why and the fix)."""


class TaskNotFoundError(KVBackendError, KeyError):
    """A task id passed to ``launch`` or ``cancel`` is not a live, un-launched task."""


def task_id(value: object) -> int:
    """A task id as an int; ``ValueError`` when it is not an integer (a bool neither)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"task id {value!r} is not an integer")
    return int(value)


def launch_task_ids(task_ids: Sequence[object], slot_mappings: Sequence[object]) -> list[int]:
    """The ids of a ``launch`` call as ints, checked against its slot mappings.

    Raises ``ValueError`` naming the bad value when an id is not an integer, when
    the counts differ, or when an id repeats; backends call it before touching
    any task, so a refused call launches nothing.
    """
    ids = []
    for t in task_ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(
                f"launch: task id {t!r} is not an integer; pass the id a match returned"
            )
        ids.append(int(t))
    if len(slot_mappings) != len(ids):
        raise ValueError(
            f"launch: {len(ids)} task ids but {len(slot_mappings)} slot mappings; pass one "
            "slot mapping per task"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"launch: task ids {ids} repeat an id; launch each task once")
    return ids


class KVBackend(abc.ABC):
    """Abstract FlexKV-shaped KV cache manager for one PP stage of one node.

    Thread safety: every method may be called from any thread. Methods other
    than ``wait`` never block on transfers.
    """

    #: Tokens per cache block; block identity and mask alignment use it.
    tokens_per_block: int

    # -- lifecycle ---------------------------------------------------------

    @abc.abstractmethod
    def start(self) -> None:
        """Allocate tiers and start worker threads. Idempotent."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True only when started and every expected engine rank registered its buffers."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop workers; in-flight tasks end FAILED or CANCELLED. Idempotent."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every cached block and every task (a cache flush). Registered
        buffers stay registered. Outstanding tasks end CANCELLED."""

    @abc.abstractmethod
    def register_kv_buffers(
        self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """Register engine rank ``rank``'s KV buffers (CUDA or CPU tensors).

        ``buffers`` is arranged as the backend's layout names it (see
        :mod:`node_agent.backend.planes`: for SGLang MHA ``(k_buffer, v_buffer)``,
        for MLA ``(kv_buffer,)``). The backend keeps views of the engine's memory,
        never copies. Raises ``ValueError`` naming the bad rank, list, shape,
        dtype or device with nothing registered. Registering a rank again
        replaces its buffers (an engine restart); it must not happen while
        that rank has launched tasks (``KVBackendError``).
        """

    def stats(self) -> BackendStats:
        """Tier capacity/use, evictions, hits and task counts (empty by default)."""
        return BackendStats()

    # -- matching -----------------------------------------------------------

    def get_match(
        self,
        token_ids: TokenArray,
        token_mask: BoolMask | None = None,
        namespace: str | None = None,
    ) -> tuple[int, BoolMask]:
        """Find the cached prefix of ``token_ids`` and open a load task for it.

        ``token_mask`` (optional) marks the tokens the caller wants loaded; tokens
        before the first True are treated as already resident in the engine (their
        blocks must still be cached for the prefix chain to hold). Returns
        ``(task_id, mask)`` where mask is True over the loadable span; task id is
        -1 and the mask all False when nothing can be loaded. The matched blocks
        are locked (cannot be evicted) until the task is launched and finishes,
        is cancelled, or expires un-launched. Token ids are read by
        :func:`node_agent.vocab.tokens.int64_array` (``ValueError`` names a bad one).
        """
        return self._match("get", int64_array("token_ids", token_ids), token_mask, namespace)

    def put_match(
        self,
        token_ids: TokenArray,
        token_mask: BoolMask | None = None,
        namespace: str | None = None,
    ) -> tuple[int, BoolMask]:
        """Open a store task for the blocks of ``token_ids`` not yet cached.

        Returns ``(task_id, mask)`` where mask is True over the uncached,
        block-aligned span after the cached prefix; task id is -1 and the mask
        all False when nothing needs writing. Space for the span is reserved;
        the new blocks become visible to ``get_match`` only when the task
        finishes SUCCESS. Token ids are read as by :meth:`get_match`.
        """
        return self._match("put", int64_array("token_ids", token_ids), token_mask, namespace)

    @abc.abstractmethod
    def _match(self, op: MatchOp, tokens: TokenArray, token_mask: BoolMask | None,
               namespace: str | None) -> tuple[int, BoolMask]:
        """What each backend implements: :meth:`get_match` (``op == "get"``) or
        :meth:`put_match` (``"put"``) of already checked ``tokens``."""

    # -- execution ----------------------------------------------------------

    def launch(
        self,
        task_ids: Sequence[int],
        slot_mappings: Sequence[SlotArray],
        as_batch: bool = False,
    ) -> list[int]:
        """Bind engine KV slots to matched tasks and start their transfers.

        ``slot_mappings[i]`` holds one slot per True entry of task ``task_ids[i]``'s
        mask. Slots are validated (1-D integer, in range of the registered
        buffers, non-negative, no duplicates within a task) before anything moves;
        a bad mapping raises ``ValueError`` naming the bad value and leaves every
        task of the call un-launched. Returns the ids to wait on: the same ids,
        or with ``as_batch`` one new id covering all of them (callers must use it).
        The ids are checked first (:func:`launch_task_ids`).
        """
        return self._launch(launch_task_ids(task_ids, slot_mappings), slot_mappings, as_batch)

    @abc.abstractmethod
    def _launch(self, ids: list[int], slot_mappings: Sequence[SlotArray],
                as_batch: bool) -> list[int]:
        """What each backend implements: :meth:`launch` of checked task ``ids``
        (ints, one per slot mapping, none repeated)."""

    def wait(
        self,
        task_ids: Sequence[int],
        timeout: float = 20.0,
        completely: bool = False,
    ) -> dict[int, KVResponse]:
        """Block until the tasks finish or ``timeout`` seconds pass.

        Returns one response per id. Finished tasks are reaped (a later wait
        answers NOTFOUND). Unfinished ones answer TIMEOUT and stay live. With
        ``completely`` the call returns only when all tasks are terminal or the
        timeout expired; otherwise it may return as soon as any is terminal.
        Every id must be an integer (:func:`task_id`).
        """
        return self._wait([task_id(t) for t in task_ids], timeout, completely)

    @abc.abstractmethod
    def _wait(self, ids: list[int], timeout: float, completely: bool) -> dict[int, KVResponse]:
        """What each backend implements: :meth:`wait` for checked task ``ids``."""

    @abc.abstractmethod
    def try_wait(self, task_ids: Sequence[int]) -> dict[int, KVResponse]:
        """Non-blocking ``wait``: returns only the tasks that are terminal, reaped."""

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` (from any thread, no lock held) whenever a launched
        task becomes terminal, so a caller polling ``try_wait`` can look at once;
        ``None`` removes it. The default keeps no listener: callers of a backend
        that cannot notify keep polling (their own bounded interval)."""
        return None

    @abc.abstractmethod
    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back un-launched tasks (unlock matched blocks, release reserved
        space; they end CANCELLED at once) and stop launched, unfinished ones.

        A launched task's copy is asked to stop (it checks between run / plane
        copies); the task then ends CANCELLED as soon as the copy stopped, and
        ``wait`` answers that terminal status. A cancelled put's blocks never
        become visible and their space is freed; a cancelled get's slots hold
        undefined data. Once ``wait`` has answered CANCELLED nothing writes the
        task's slots or blocks. Finished and unknown ids are ignored. A backend
        whose transfer engine cannot be interrupted (the FlexKV adapter) leaves
        launched tasks running and says so in its own docstring."""
