"""The NVML backend: the only package that imports `pynvml` (package nvidia-ml-py).

Every NVML call goes through `NvmlCalls._call`, which looks the function up on the
`pynvml` module at call time and turns every `pynvml.NVMLError` into a `GpuError` whose
kind comes from `classify` (the one place NVML return codes are interpreted). Units are
converted at the boundary: NVML's milliwatts become watts; MHz, Celsius, percent,
bytes and nanoseconds pass through unchanged.

Where NVML renamed or versioned a call, the modern name is tried first and the older one
is used when nvidia-ml-py lacks the new name or the driver lacks the symbol
(NVML_ERROR_FUNCTION_NOT_FOUND), so one agent build runs on old and new drivers alike.

The one thing NVML cannot do, a GPU reset, runs `nvidia-smi --gpu-reset` (reset_gpu).

Where things are
----------------
- `calls`      the one way NVML is called, error classification, device handles, library calls
- `reads`      identity and the per-GPU readings (hot and slower, fans, modes, counters, processes)
- `profiling`  GPM activity, field values, NVLink state and counters, the NVSwitch fabric
- `events`     the Xid/ECC event set and `wait_events`
- `setters`    the guarded setters
- `backend`    `NvmlBackend`: the session (init, shutdown, the GPU reset) composed of the parts above
"""

from agent.backend.nvml.backend import NvmlBackend
from agent.backend.nvml.calls import classify, to_gpu_error

__all__ = ["NvmlBackend", "classify", "to_gpu_error"]
