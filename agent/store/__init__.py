"""What survives a restart: SQLite events, the remediation journal, node memory, acks."""
