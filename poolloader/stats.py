"""Counters a user reads to tell whether the loader is the bottleneck, and which side:
`LoaderStats` (`loader.stats`; `stats.advice()` reads them).

This is the public face; the class lives in poolloader.main.stats, next to the iterator
that updates it and the advice that reads it.
"""
from poolloader.main.stats import LoaderStats

__all__ = ["LoaderStats"]
