"""The engine's torch-free core: requests and their hints, the block pool and prefix index, the
scheduler, the tier policy and cost model, and the scheduler side of the KV connector. Plain
Python over ints and lists, unit-tested in milliseconds; nothing here may import torch (a test
checks)."""
