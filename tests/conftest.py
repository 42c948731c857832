"""Pick the device before anything imports triton: the GPU when there is one, else the Triton interpreter."""
from codabench.bootstrap import select_device

select_device()
