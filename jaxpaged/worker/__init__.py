"""The worker: the model runner, its step programs over the paged KV pool, and their compilation.

`ModelRunner` takes a `SchedulerOutput`, runs one jitted step program (forward and sampler) over the
donated, page-indexed KV pool and returns a `ModelRunnerOutput`; the runner never calls back up.
"""
