"""The local backend: runs in threads of the driver on this machine's GPU slots (``backend.py``), placed by one
scheduler (``scheduler.py``); the GPUs found and packed (``gpus.py``) and a private CUDA MPS daemon (``mps.py``).

Nothing is imported here, so that the widgets can read ``gpus`` without loading the notebook runtime."""
