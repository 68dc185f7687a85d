"""Sequence runs' data and evaluation: user histories packed into batches, a stream of
them, full-ranking evaluation and the non-learned baselines (the task is
`training.tasks.sequence_task`).
"""
