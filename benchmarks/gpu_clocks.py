"""SM clock and board power of one GPU, sampled in a background thread through NVML (`bench.py --log-clocks`).

Why: on the H100, flashcore's fwd+bwd at 4x16x8192x128 ran ~13 % slower in the rounds where cuDNN's backward ran
just before it (bench.py rotates the backend order each round), while cuDNN's own rounds stayed within 3 %. If
the GPU lowers its clocks after a power-hungry round, the per-round clocks show it. NVML is reached with ctypes
(`libnvidia-ml.so.1`, part of the driver), so no Python package is needed.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from typing import Optional

_NVML_CLOCK_SM = 1


class ClockLog:
    """Samples (time.perf_counter(), SM MHz, watts) every `period_s` until close(); window(t0, t1) summarizes the
    samples taken in [t0, t1]. `index` is the NVML device index (the CUDA index when no CUDA_VISIBLE_DEVICES
    reordering is in effect)."""

    def __init__(self, index: int = 0, period_s: float = 0.005):
        self.samples: list[tuple[float, float, float]] = []
        self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._nvml.nvmlInit_v2(), "nvmlInit_v2")
        self._handle = ctypes.c_void_p()
        self._check(self._nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self._handle)),
                    "nvmlDeviceGetHandleByIndex_v2")
        self._period = period_s
        self._stop = threading.Event()
        self._sample()  # fail here, not in the thread, if the queries do not work
        self._thread = threading.Thread(target=self._run, name="gpu-clock-log", daemon=True)
        self._thread.start()

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed (NVML status {status})")

    def _sample(self) -> None:
        mhz, mw = ctypes.c_uint(), ctypes.c_uint()
        self._check(self._nvml.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)),
                    "nvmlDeviceGetClockInfo")
        self._check(self._nvml.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(mw)), "nvmlDeviceGetPowerUsage")
        self.samples.append((time.perf_counter(), float(mhz.value), mw.value / 1000.0))

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._sample()
            except RuntimeError:
                return

    def window(self, t0: float, t1: float) -> Optional[dict]:
        sel = [(m, w) for t, m, w in list(self.samples) if t0 <= t <= t1]
        if not sel:
            return None
        mhz = [m for m, _ in sel]
        return {"sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
                "power_w_median": statistics.median(w for _, w in sel), "samples": len(sel)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._nvml.nvmlShutdown()
