"""The training process's side: the iterator, the ledger of who owns each slot, the
supervision of worker processes, and the advice read from the counters."""
