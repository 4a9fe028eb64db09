"""torchlaunch: launch PyTorch training on one GPU, N GPUs, Slurm or Kubernetes, and resume exactly."""
