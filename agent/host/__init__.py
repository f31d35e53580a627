"""Host access: every path under /sys, /proc, /etc, /run goes through `HostPaths`."""
