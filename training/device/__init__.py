"""Embedding tables on the devices: where each table lives (the plan and its budget), the
host's side of device tables (id -> row maps, ids the step maps itself), hot-row caches,
and the padded shapes of their batch arrays.
"""
