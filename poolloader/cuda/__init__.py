"""CUDA: the runtime calls (`runtime`), page-locked registration and the slot reuse
gate (`gate`), and the copy to the device one batch ahead (`staging`)."""
