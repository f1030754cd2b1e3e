"""Exact mid-epoch resume: the state_dict layout and RNG capture (`keys`), main's
record of a multi-worker epoch (`tracker`), and the num_workers=0 iterator (`single`)."""
