"""Pooling loaders a script builds without editing it: the `DataLoader.__new__` hook
(`hook`) and `python -m poolloader` (`runner`)."""
