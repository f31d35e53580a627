"""What the agent reads of each GPU, declared once per reading: `row.py` says what a row holds,
`table.py` is the table itself (`GpuSample`, whose reading fields are the rows) and `composite.py`
reads and shapes the readings that are more than one value."""
