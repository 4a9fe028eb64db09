"""The launch commands users type (`python -m launch.local|slurm|k8s`); the code is torchlaunch.launch."""
