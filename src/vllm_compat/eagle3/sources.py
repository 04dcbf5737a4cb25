"""Where the trainer's samples come from: the one interface both training loops read.

A source has ``manifest`` (hidden size, layer ids, the target it was extracted from: what
the draft is built for), ``dir`` (named in messages), ``len()`` (samples per epoch) and
``batches(steps, make_batch, depth)``: the batch of every step of ``steps`` (a
:class:`~vllm_compat.eagle3.training.StepBatches`), in order, built by ``make_batch`` from
the samples of the step's indices. The indices, and so the data order, are chosen by the
trainer; a source only supplies sample ``i``.

:class:`ShardSource` reads an extracted dataset (offline training);
:class:`vllm_compat.eagle3.online.OnlineSource` extracts the states while training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from .data import HiddenStatesDataset, Manifest

Sample = dict[str, torch.Tensor]
MakeBatch = Callable[[list[Sample]], dict[str, torch.Tensor]]


class DescribedStates(Protocol):
    """What the draft is built for: the states' manifest (sizes, layer ids, target)."""

    manifest: Manifest
    dir: Any


class TrainingSource(DescribedStates, Protocol):

    def __len__(self) -> int: ...

    def batches(self, steps: Iterable[list[int]], make_batch: MakeBatch, depth: int
                ) -> Iterator[dict[str, torch.Tensor]]: ...

    def scalars(self) -> dict[str, float]: ...

    def progress(self) -> dict[str, str]: ...

    def close(self) -> None: ...


class DeviceSamples(torch.utils.data.Dataset):
    """Every sample of ``dataset`` read once (shards checked and NaN/Inf-checked as usual) and
    kept on ``device``; ``manifest`` and ``dir`` are the dataset's. Build it once and pass it
    to several :func:`train` calls (``samples=``) to read the files once."""

    def __init__(self, dataset: HiddenStatesDataset, device: torch.device | str) -> None:
        self.manifest, self.dir, self.device = dataset.manifest, dataset.dir, _device_of(device)
        self._samples = [{k: v.to(self.device) for k, v in dataset[i].items()} for i in range(len(dataset))]

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._samples[i]


def _device_of(device: torch.device | str) -> torch.device:
    """The device a tensor placed on ``device`` reports (``cuda`` -> ``cuda:0``)."""
    return torch.empty(0, device=device).device


def prefetched(make: Any, items: Any, depth: int) -> Iterator[Any]:
    """``make(item)`` for each item, in order, computed up to ``depth`` items ahead in one
    background thread (``depth`` 0: on demand, in the caller's thread). One thread, so
    ``make`` may keep state (the dataset keeps a shard open); torch's copies and file reads
    release the GIL, so building overlaps the caller's GPU step."""
    if depth <= 0:
        yield from map(make, items)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    it = iter(items)
    with ThreadPoolExecutor(1, thread_name_prefix="draft-batches") as pool:
        window = deque(pool.submit(make, x) for _, x in zip(range(depth), it))
        while window:
            fut = window.popleft()
            nxt = next(it, _END)
            if nxt is not _END:
                window.append(pool.submit(make, nxt))
            yield fut.result()


_END = object()


class ShardSource:
    """Samples read from shards (:class:`HiddenStatesDataset`, or :class:`DeviceSamples`:
    the same samples already on the training device). Batches are built up to ``depth``
    steps ahead by one background thread (the same batches in the same order for any
    depth)."""

    def __init__(self, dataset: HiddenStatesDataset | DeviceSamples) -> None:
        self.dataset = dataset
        self.manifest: Manifest = dataset.manifest
        self.dir: Path = Path(dataset.dir)

    @property
    def on_device(self) -> bool:
        return isinstance(self.dataset, DeviceSamples)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Sample:
        return self.dataset[i]

    def batches(self, steps: Iterable[list[int]], make_batch: MakeBatch, depth: int
                ) -> Iterator[dict[str, torch.Tensor]]:
        return prefetched(lambda idx: make_batch([self.dataset[i] for i in idx]), steps, depth)

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars of the last step beside the training metrics (none here)."""
        return {}

    def progress(self) -> dict[str, str]:
        """What the progress bar shows beside the loss (nothing here)."""
        return {}

    def close(self) -> None:
        pass
