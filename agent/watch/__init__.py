"""Watchers: Xid (NVML events and kernel log), throttling, memory, lost GPUs, PCIe, service health."""
