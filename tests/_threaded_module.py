"""A module that starts a thread when imported (test_zygote: a zygote must not fork
with it running unannounced)."""
import threading
import time

import torch
from torch.utils.data import Dataset

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


class Threaded(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(i)
