"""The engine's host-side core: requests, the scheduler and its output, the KV page pool.

Plain Python and numpy, no device arrays: `Scheduler.schedule()` decides what each running
request computes next and returns a `SchedulerOutput`, the one record the worker reads.
"""
