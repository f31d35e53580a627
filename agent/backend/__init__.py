"""GPU backends: the NVML one (real hardware) and the simulated one (tests, demo)."""
