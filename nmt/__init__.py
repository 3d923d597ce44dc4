"""nmt: attention-based RNN encoder-decoder machine translation."""

__version__ = "0.1.0"

# Cap of oneDNN's kernel cache (nmt.runtime says why). It lives here, free of torch, because
# the command line sets it before anything imports torch.
ONEDNN_CACHE_CAPACITY = "32"
