"""GPU utilisation and memory through NVML, read at scrape time; nothing without NVML.

``pynvml`` (the ``nvidia-ml-py`` package) is optional: when it cannot be imported, or NVML
does not initialise (no driver, a CPU machine), :func:`nvml_collector` returns None and the
series are absent rather than zero, so a dashboard never shows a CPU host as an idle GPU.

NVML numbers devices in PCI order and ignores ``CUDA_VISIBLE_DEVICES``. When that variable
lists UUIDs (``GPU-…``) only those devices are exported; when it lists indices they are
taken as NVML indices, which matches CUDA's numbering under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics import GPU_LABELS, GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GPU_UTILIZATION

log = logging.getLogger(__name__)


class NvmlCollector(Collector):
    """Three gauges per device, labelled ``gpu`` with the NVML index and ``group`` and
    ``model`` with what ``owner()`` says the process serves now (a worker moves groups)."""

    def __init__(
        self,
        nvml: ModuleType,
        devices: Sequence[tuple[str, Any]],
        owner: Callable[[], tuple[str, str]] = lambda: ("", ""),
    ) -> None:
        self._nvml = nvml
        self._devices = list(devices)  # (label, handle)
        self._owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = list(GPU_LABELS)
        util = GaugeMetricFamily(GPU_UTILIZATION.name, GPU_UTILIZATION.doc, labels=labels)
        used = GaugeMetricFamily(GPU_MEMORY_USED.name, GPU_MEMORY_USED.doc, labels=labels)
        total = GaugeMetricFamily(GPU_MEMORY_TOTAL.name, GPU_MEMORY_TOTAL.doc, labels=labels)
        group, model = self._owner()
        for index, handle in self._devices:
            label = [index, group, model]
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a device that fell off the bus: skip it, keep the rest
                log.debug("NVML read of gpu %s failed: %s", index, exc)
                continue
            util.add_metric(label, rates.gpu / 100.0)
            used.add_metric(label, float(memory.used))
            total.add_metric(label, float(memory.total))
        yield from (util, used, total)


def _visible(index: int, uuid: str, wanted: list[str] | None) -> bool:
    if wanted is None:
        return True
    return any(uuid.startswith(w) if w.startswith("GPU-") else w == str(index) for w in wanted)


def nvml_collector(
    env: dict[str, str] | None = None, owner: Callable[[], tuple[str, str]] = lambda: ("", "")
) -> NvmlCollector | None:
    """A collector of the visible GPUs, or None when NVML is not importable or not usable;
    ``owner``: the (group, model) the process serves now."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        env = dict(os.environ) if env is None else env
        raw = env.get("CUDA_VISIBLE_DEVICES")
        wanted = [w.strip() for w in raw.split(",") if w.strip()] if raw is not None else None
        devices = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if _visible(i, uuid, wanted):
                devices.append((str(i), handle))
    except Exception as exc:  # pynvml.NVMLError and friends: no driver, no device
        log.info("GPU metrics off: NVML unavailable (%s)", exc)
        return None
    return NvmlCollector(pynvml, devices, owner) if devices else None
