"""Several sample groups in one streaming engine call (``VllmGeneration.generate_groups_async``): the handles
the facade gives for them, and taking their outputs as the engine yields them.

One Ray call per engine carries every group submitted together (``WorkerHost.stream`` over the worker's
``generate_groups``); the engine admits them at one step and yields each group's output as soon as that group
is done. A handle names its stream and its place in it; whichever caller pulls the stream keeps the outputs
it does not want yet, so the handles can be collected in any order, alone or mixed with per-call handles.
Imports nothing heavy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.distributed import RayWorkerGroup, Stream


@dataclass(eq=False)
class GroupStream:
    """One engine's streaming call: the outputs taken from it so far (by index into the call's groups), and
    the failure that ended it, if one did."""

    stream: Stream
    groups: int
    outputs: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def generator(self) -> Any:
        """What ``ray.wait`` takes for this stream."""
        return self.stream.generator

    def has(self, index: int) -> bool:
        return index in self.outputs or self.error is not None or self.ended

    def take(self, group: RayWorkerGroup, timeout_s: float | None = None) -> None:
        """Take the stream's next output (waiting up to ``timeout_s``: ``TimeoutError``); a failure is kept
        for every group not yet out, and raised."""
        with self.lock:
            if self.error is not None or self.ended:
                return
            try:
                index, output = group.next_item(self.stream, timeout_s)
            except StopIteration:
                self.ended = True
                return
            except TimeoutError:
                raise
            except BaseException as exc:
                self.error = exc
                raise
            self.outputs[index] = output

    def output(self, index: int) -> Any:
        """Group ``index``'s output once :meth:`has` is true (raises the stream's failure)."""
        if index in self.outputs:
            return self.outputs.pop(index)
        if self.error is not None:
            raise self.error
        raise RuntimeError(f"the engine's streaming call ended without sample group {index} of {self.groups}")


@dataclass(eq=False)
class StreamedGroup:
    """The handle of one sample group of a streaming call: ``engine`` and ``rows`` for the facade's routing."""

    stream: GroupStream
    index: int
    engine: int
    rows: int

    @property
    def refs(self) -> list[Any]:
        """Nothing to wait on by itself (the stream is); a per-call handle's ``refs`` has its Ray refs."""
        return []


def collect_streamed(handle: StreamedGroup, group: RayWorkerGroup, timeout_s: float | None = None) -> Any:
    """``handle``'s output, pulling its stream until it is out."""
    while not handle.stream.has(handle.index):
        handle.stream.take(group, timeout_s)
    return handle.stream.output(handle.index)
