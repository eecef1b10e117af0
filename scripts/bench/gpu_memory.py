"""Peak GPU memory of whatever runs on the device, sampled through NVML (nvidia-ml-py).

Device-wide, so it counts a peer's engine processes as well as this one, and the same way for every
system: memory used on the GPU (CUDA contexts included) at its highest while a system ran. Peers and
ours size their KV pool from a fraction of the memory (0.9 by default), so the peak mostly shows that
budget. None where NVML is missing (CPU runs).
"""

from __future__ import annotations

import threading


class PeakGpuMemory:
    def __init__(self, device_index: int = 0, interval_s: float = 0.05):
        self.device_index, self.interval_s = device_index, interval_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = None

    def _sample(self, nvml, handle) -> None:
        while True:
            used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            self.peak_bytes = used if self.peak_bytes is None else max(self.peak_bytes, used)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self):
        try:
            import pynvml as nvml

            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception:  # no NVML (CPU machine, no driver): nothing to measure
            return self
        self._thread = threading.Thread(target=self._sample, args=(nvml, handle), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return False
