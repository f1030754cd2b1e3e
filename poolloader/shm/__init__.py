"""Shared memory and signalling: segments (memfd by default, POSIX names on request),
the control block with its rings and doorbells, the slot pool, and fork safety.

Nothing here knows what a batch is; `poolloader.wire` gives the bytes a meaning."""
