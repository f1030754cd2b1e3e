"""The worker process: its loop (`loop`), the start-up payload pickled once for spawn
and forkserver (`startup`), and the stack dump a stuck worker leaves (`stall`)."""
