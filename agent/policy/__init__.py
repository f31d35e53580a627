"""Node policy: one module per item (observe -> plan -> apply), orchestrated by `engine`."""
