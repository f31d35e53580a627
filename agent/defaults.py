"""Default paths and ports, importable without the config models (the CLI's fast paths use them)."""

DEFAULT_CONFIG_PATH = "/etc/gpu-agent/agent.yaml"
DEFAULT_RULES_DIR = "/etc/gpu-agent/rules.d"  # the admin's rules; before rules_dirs, the only one
# Lowest priority first: the packages' rules, then the admin's (agent/rules/sources.py).
DEFAULT_RULES_DIRS = ("/usr/share/gpu-agent/rules.d", DEFAULT_RULES_DIR)
#: The daemon's runtime directory (systemd's RuntimeDirectory=): the socket, and what the daemon
#: publishes of the config it runs (agent/api.py `read_published`).
DEFAULT_RUNTIME_DIR = "/run/gpu-agent"
DEFAULT_SOCKET_PATH = f"{DEFAULT_RUNTIME_DIR}/agent.sock"
DEFAULT_METRICS_PORT = 9481  # unused by node_exporter (9100), dcgm-exporter (9400), nvidia_gpu_exporter (9835)
MAX_YAML_BYTES = 1024 * 1024  # the largest config or rules file read (agent.safe_yaml)
REBOOT_FLAG_NAME = "reboot-recommended"  # in state_dir: the reboot actions' recommendation, read by the verdict
