"""What the agent reads of each GPU, declared once per reading: `row.py` says what a row holds, and
`table.py` is the table itself (`GpuSample`, whose reading fields are the rows)."""
