"""Per-layer loading (L2 -> L1) overlapped with the forward pass.

vLLM calls ``wait_for_layer_load(layer_name)`` right before each attention layer runs; only that layer's pages
need to be in L1 by then, so the load of layer ``l+1`` can run while layer ``l`` computes. This follows SGLang
HiCache's layer-wise load-back (one event per layer, the attention layer waits on its own event) adapted to a
plug-in:

* CPU tensors: a background thread loads layer 0, 1, ... (torch copies release the GIL, so the model's own
  compute runs meanwhile) and sets one ``threading.Event`` per layer; :meth:`LayerwiseLoad.wait_layer` blocks on it.
* CUDA tensors: every layer's copy is queued on the transfer side stream right away, with a CUDA event per layer;
  :meth:`LayerwiseLoad.wait_layer` makes the current stream wait on that event (stream order, no host stall).

A failure (an exception in the copy thread) is re-raised by the next ``wait_layer``/``wait_all`` in the caller's
thread, so the connector can report the blocks as failed instead of running with a hole in the prefix.
"""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

from tierkv.kernels import load_pages, validate_transfer

from tierkv.connector.obs.thread_names import name_this_thread


class LayerwiseLoad:
    """Loads pages ``slots[i] -> block_ids[i]`` layer by layer on a background thread (CPU) or side stream (CUDA).

    Args:
        host: the :class:`~tierkv.connector.l2.host_pool.HostPool` (source).
        dev: the :class:`~tierkv.connector.l2.device_pool.DevicePool` (destination).
        slots, block_ids: equal-length int sequences (validated here, ValueError before anything moves).
        impl: force ``"torch"`` or ``"triton"`` (default: by device).
        copies: instead of ``slots``/``block_ids`` (pass them empty): ``(layers, slots, block_ids)`` triples, each
            copied only into its ``layers`` (None = every layer): a hybrid model's KV cache groups, each with its
            own blocks (``CacheWorker._copies``). Layer ``l`` is ready once every triple holding it is copied.
            ``block_ids`` is then every triple's blocks.
    Attributes:
        timeline: after completion, per layer ``(layer, start_s, end_s)`` (``time.perf_counter`` seconds) of the copy
            (CPU path; on CUDA the host-side enqueue times).
    """

    def __init__(self, host, dev, slots: Sequence[int], block_ids: Sequence[int], *, impl: Optional[str] = None,
                 copies: Optional[Sequence[tuple[Optional[Sequence[int]], Sequence[int], Sequence[int]]]] = None):
        self.host, self.dev = host, dev
        self.num_layers = dev.num_layers
        if copies is None:
            copies = [(None, slots, block_ids)]
        elif len(slots) or len(block_ids):
            raise ValueError("LayerwiseLoad: give slots and block_ids, or copies, not both")
        checked = []
        for layers, c_slots, c_blocks in copies:
            b, s, ls = validate_transfer(dev, host, c_blocks, c_slots, layers)
            checked.append((set(range(self.num_layers)) if ls is None else set(ls), s, b))
        #: per layer: the (slots, block ids) copied into it
        self._per_layer = [[(s, b) for ls, s, b in checked if layer in ls and b] for layer in range(self.num_layers)]
        self.block_ids = [x for _ls, _s, b in checked for x in b]
        self.slots = [x for _ls, s, _b in checked for x in s]
        self.impl = impl
        self._events = [threading.Event() for _ in range(self.num_layers)]
        self._cuda_events: list = []
        self._error: Optional[BaseException] = None
        self._failed_layer = self.num_layers  # layers >= this one did not load
        self._thread: Optional[threading.Thread] = None
        self._started = False
        self._cancel = False
        self.timeline: list[tuple[int, float, float]] = []
        self._cuda = dev.device.type == "cuda" and impl in (None, "triton")

    def start(self) -> None:
        """Begin loading (idempotent)."""
        if self._started:
            return
        self._started = True
        if not self.block_ids:
            for e in self._events:
                e.set()
            return
        if self._cuda:
            for layer in range(self.num_layers):
                t0 = time.perf_counter()
                ev = None
                for slots, blocks in self._per_layer[layer]:
                    ev = load_pages(self.host, self.dev, slots, blocks, [layer], impl=self.impl, sync=False)
                if ev is None:  # no block of this layer: an event recorded now marks it ready
                    import torch
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.dev.device))
                self._cuda_events.append(ev)
                self.timeline.append((layer, t0, time.perf_counter()))
                self._events[layer].set()
            return
        self._thread = threading.Thread(target=self._run, name="tierkv-layerwise-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_this_thread()
        layer = 0
        try:
            for layer in range(self.num_layers):
                if self._cancel:
                    raise RuntimeError("layer-wise load cancelled")
                t0 = time.perf_counter()
                for slots, blocks in self._per_layer[layer]:
                    load_pages(self.host, self.dev, slots, blocks, [layer], impl=self.impl)
                self.timeline.append((layer, t0, time.perf_counter()))
                self._events[layer].set()
        except BaseException as e:  # surfaced in wait_layer/wait_all
            self._failed_layer = layer
            self._error = e
            for e_ in self._events[layer:]:
                e_.set()

    def wait_layer(self, layer_index: int) -> None:
        """Block until layer ``layer_index``'s pages are in L1 (CUDA: the current stream waits for them).
        Starts the load if needed. Raises ValueError for a bad index, or re-raises the copy's failure."""
        if isinstance(layer_index, bool) or not isinstance(layer_index, int) or not 0 <= layer_index < self.num_layers:
            raise ValueError(f"layer_index {layer_index!r} out of range [0, {self.num_layers})")
        self.start()
        self._events[layer_index].wait()
        if self._error is not None and layer_index >= self._failed_layer:
            raise RuntimeError(f"layer-wise load failed at layer {self._failed_layer}, needed layer "
                               f"{layer_index}") from self._error
        if self._cuda_events:
            import torch
            torch.cuda.current_stream(self.dev.device).wait_event(self._cuda_events[layer_index])

    def wait_all(self) -> None:
        """Block until every layer is loaded (CUDA: until the copies finished on the device)."""
        self.start()
        if self._thread is not None:
            self._thread.join()
        for e in self._events:
            e.wait()
        if self._error is not None:
            raise RuntimeError("layer-wise load failed") from self._error
        for ev in self._cuda_events:
            ev.synchronize()

    @property
    def failed_layer(self) -> Optional[int]:
        """The first layer whose copy failed (layers from it on are not in L1), or None while none failed."""
        return self._failed_layer if self._error is not None else None

    def cancel(self) -> None:
        """Stop after the layer in progress; later waits raise."""
        self._cancel = True

    @property
    def done(self) -> bool:
        return all(e.is_set() for e in self._events) and (self._thread is None or not self._thread.is_alive())
